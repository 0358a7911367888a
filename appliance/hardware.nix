# Boot and disks of the appliance. The raw-efi image (packages.appliance-image) holds an EFI system partition
# labelled ESP and a root file system labelled nixos; the same labels are used here, so the toplevel and the image
# describe one machine. The weights partition is made by the operator on a disk of its own:
#
#   mkfs.ext4 -L glm53-data /dev/nvme1n1
{
  boot.loader.systemd-boot.enable = true;
  # A copied image must not rewrite the firmware's boot order of the machine it lands on.
  boot.loader.efi.canTouchEfiVariables = false;
  boot.initrd.availableKernelModules = [
    "nvme"
    "ahci"
    "xhci_pci"
    "sd_mod"
    "usb_storage"
    "virtio_pci"
    "virtio_blk"
  ];
  boot.growPartition = true;

  fileSystems."/" = {
    device = "/dev/disk/by-label/nixos";
    fsType = "ext4";
    autoResize = true;
  };
  fileSystems."/boot" = {
    device = "/dev/disk/by-label/ESP";
    fsType = "vfat";
    options = [ "umask=0077" ];
  };
  # The service runs as a dynamic user, whose state directory systemd keeps at /var/lib/private/glm53 and hands to
  # that user at every start: mounting the weights partition there makes the download and the caches writable by
  # the service and by nobody else. nofail: a machine without the partition still boots and can be reached over
  # SSH; the service then does not start (RequiresMountsFor in default.nix).
  fileSystems."/var/lib/private/glm53" = {
    device = "/dev/disk/by-label/glm53-data";
    fsType = "ext4";
    options = [
      "nofail"
      "x-systemd.device-timeout=30s"
    ];
  };
  # Creating the mount point leaves /var/lib/private world-readable (0755); systemd wants it 0700, the boundary that
  # keeps other users out of dynamic users' files.
  systemd.tmpfiles.rules = [ "d /var/lib/private 0700 root root -" ];
}
