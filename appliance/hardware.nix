# Boot and disks of the appliance. The weights partition is made by the operator on a disk of its own:
#
#   mkfs.ext4 -L glm53-data /dev/nvme1n1
{ lib, ... }:
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

  # At the priority of nixpkgs' disk-image module (nixos/modules/virtualisation/disk-image.nix, which builds the
  # raw-efi image), which sets its own "/" and "/boot" with lib.mkImageMediaOverride (priority 60): a definition at
  # the normal priority (100) would be dropped from the image as a whole, the data partition with it, and the 125 GB
  # download would land on the root file system. At equal priority the two merge. A configuration extending the
  # appliance with file systems of its own must define them at this priority too.
  fileSystems = lib.mkImageMediaOverride (import ./mounts.nix);

  # Creating the mount point leaves /var/lib/private world-readable (0755); systemd wants it 0700, the boundary that
  # keeps other users out of dynamic users' files.
  systemd.tmpfiles.rules = [ "d /var/lib/private 0700 root root -" ];
}
