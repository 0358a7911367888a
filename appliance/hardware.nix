# Boot and disks of the appliance. The weights partition is made by the operator on a disk of its own:
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

  # At the normal priority, where nixpkgs' disk-image module (nixos/modules/virtualisation/disk-image.nix, which builds
  # the raw-efi image) defines its "/" and "/boot" too: the definitions merge, so the image keeps the weights
  # partition and /boot's umask, and file systems a configuration extending the appliance adds are kept as well.
  # checks.appliance-mounts fails if a nixpkgs drops any of them from the image again.
  fileSystems = import ./mounts.nix;

  # Creating the mount point leaves /var/lib/private world-readable (0755); systemd wants it 0700, the boundary that
  # keeps other users out of dynamic users' files.
  systemd.tmpfiles.rules = [ "d /var/lib/private 0700 root root -" ];
}
