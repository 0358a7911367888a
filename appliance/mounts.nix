# The appliance's file systems, as data (builtins only): hardware.nix mounts them, checks.appliance-mounts asserts
# that the disk image's evaluated configuration still holds every one (nix/lib/mounts.nix), and the golden tests
# check both without nixpkgs.
{
  # The labels are those of the raw-efi image (packages.appliance-image): an EFI system partition labelled ESP and a
  # root file system labelled nixos, so the toplevel and the image describe one machine.
  "/" = {
    device = "/dev/disk/by-label/nixos";
    fsType = "ext4";
    autoResize = true;
  };
  "/boot" = {
    device = "/dev/disk/by-label/ESP";
    fsType = "vfat";
    options = [ "umask=0077" ];
  };
  # The service runs as a dynamic user, whose state directory systemd keeps at /var/lib/private/glm53 and hands to
  # that user at every start: mounting the weights partition there makes the download and the caches writable by
  # the service and by nobody else. nofail: a machine without the partition still boots and can be reached over
  # SSH; the service then does not start (RequiresMountsFor in default.nix).
  "/var/lib/private/glm53" = {
    device = "/dev/disk/by-label/glm53-data";
    fsType = "ext4";
    options = [
      "nofail"
      "x-systemd.device-timeout=30s"
    ];
  };
}
