# The appliance: a headless NixOS host with an NVIDIA GPU that boots into the glm53 service.
#
# Model weights never go into the image: they live on a partition labelled glm53-data (mounted as the service's
# state directory, see hardware.nix) and the service downloads them there on first boot. To log in, add an SSH
# key by extending this configuration (README, "The appliance").
{
  config,
  lib,
  ...
}:
let
  keyFile = "/var/lib/glm53-secrets/api-key.env";
  rootKeys = config.users.users.root.openssh.authorizedKeys;
  driver = import ../nix/lib/driver.nix;
  nvidiaPackages = config.boot.kernelPackages.nvidiaPackages;
  driverVersion = config.hardware.nvidia.package.version;
in
{
  imports = [ ./hardware.nix ];

  system.stateVersion = "26.05";
  # flake.nix calls lib.nixosSystem without a system and sets nixpkgs.pkgs, which leaves this option undefined: a
  # module that reads config.nixpkgs.hostPlatform would throw. The flake's pkgs are built for the same platform.
  nixpkgs.hostPlatform = "x86_64-linux";
  networking.hostName = "glm53";

  # The NVIDIA driver, chosen here and not by the service module: the production branch if it supports CUDA 13.2
  # fully (the 595 series or newer), else the latest branch if that does, else production (nix/lib/driver.nix).
  services.xserver.videoDrivers = [ "nvidia" ]; # selects the driver, on a headless host too
  hardware.graphics.enable = true; # /run/opengl-driver/lib, where Nix programs find libcuda.so.1
  hardware.nvidia = {
    open = true;
    package = driver.choose [
      nvidiaPackages.production
      nvidiaPackages.latest
    ];
    # Keeps the GPU initialised between clients, so a restart of the service does not pay for it.
    nvidiaPersistenced = true;
    nvidiaSettings = false;
  };
  assertions = [
    {
      assertion = driver.support driverVersion != "unsupported";
      message = "the appliance needs an NVIDIA driver of the ${driver.minimum} series or newer for CUDA 13, ${driver.full} or newer for full CUDA 13.2 support (got ${driverVersion})";
    }
  ];

  services.glm53 = {
    enable = true;
    mode = "fast";
    host = "0.0.0.0";
    openFirewall = true;
    download = true;
    environmentFile = keyFile;
  };
  systemd.services.glm53 = {
    requires = [ "glm53-api-key.service" ];
    after = [ "glm53-api-key.service" ];
    # Without the data partition the download would fill the root file system: do not start then.
    unitConfig.RequiresMountsFor = [ "/var/lib/private/glm53" ];
  };

  # An API served to the network gets a key: made once, on first boot, readable by root only. Read it with
  # `ssh root@HOST cat /var/lib/glm53-secrets/api-key.env`.
  systemd.services.glm53-api-key = {
    description = "Create the API key of glm53";
    wantedBy = [ "glm53.service" ];
    before = [ "glm53.service" ];
    unitConfig.ConditionPathExists = "!${keyFile}";
    serviceConfig = {
      Type = "oneshot";
      UMask = "0077";
    };
    script = ''
      mkdir -p "$(dirname ${keyFile})"
      key=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
      printf 'GLM53_API_KEY=%s\n' "$key" > ${keyFile}.new
      mv ${keyFile}.new ${keyFile}
    '';
  };

  services.openssh = {
    enable = true;
    settings = {
      PasswordAuthentication = false;
      KbdInteractiveAuthentication = false;
      PermitRootLogin = "prohibit-password";
    };
  };
  # A driver short of full CUDA 13.2 support (neither branch is, at some nixpkgs) is warned about by the module.
  warnings = lib.optional (rootKeys.keys == [ ] && rootKeys.keyFiles == [ ]) ''
    The appliance has no SSH key for root, so nobody can log in to read the API key or inspect the service.
    Extend nixosConfigurations.appliance with users.users.root.openssh.authorizedKeys.keys (see the README).
  '';

  nix.settings = {
    experimental-features = [
      "nix-command"
      "flakes"
    ];
    # nixpkgs' CUDA builds for its default configuration; this project's own packages (other capabilities, its
    # wheels) are built by the release builder and are not in any public cache.
    extra-substituters = [ "https://cache.nixos-cuda.org" ];
    extra-trusted-public-keys = [ "cache.nixos-cuda.org:74DUi4Ye579gUqzH4ziL9IyiJBlDpMRn9MBN8oNan9M=" ];
  };
}
