# checks.module-options: services.glm53 in a small NixOS configuration that sets every option away from its default,
# evaluated with nixpkgs' own module system and systemd unit generation. Evaluating the check asserts that each option
# reaches the unit, the firewall or nix.settings; building it only writes the rendered unit (its store paths are not
# built), so `nix flake check` stays cheap. nix/ci/eval.nix also evaluates the configuration's toplevel and requires
# it to warn about nothing.
{
  lib,
  runCommand,
  nixosSystem,
  module,
  # the flake's packages for this system
  packages,
}:
let
  system = nixosSystem {
    modules = [
      module
      (
        { config, ... }:
        {
          system.stateVersion = "26.05";
          nixpkgs.hostPlatform = "x86_64-linux";
          nixpkgs.config.allowUnfree = true;
          boot.loader.grub.enable = false;
          fileSystems."/" = {
            device = "/dev/disk/by-label/nixos";
            fsType = "ext4";
          };
          # The host's driver, as the README's NixOS example sets it.
          services.xserver.videoDrivers = [ "nvidia" ];
          hardware.graphics.enable = true;
          hardware.nvidia.open = true;
          hardware.nvidia.package = config.boot.kernelPackages.nvidiaPackages.production;

          services.glm53 = {
            enable = true;
            mode = "exact";
            # Another program than the mode's default: the unit must start this one, with --mode exact.
            package = packages.serve-fast;
            host = "::";
            port = 8000;
            modelDir = "/var/lib/glm53/models/GLM-5.3-Flash-exl3";
            download = true;
            repo = "turboderp/GLM-5.3-Flash-exl3";
            revision = "332ab457b709b7ba30dd9a448be5de03b80a7ac9";
            extraArgs = [
              "--max-batch-size"
              "4"
            ];
            environment.GLM53_VRAM_LIMIT_GB = "22";
            environmentFile = "/run/secrets/glm53.env";
            openFirewall = true;
            binaryCaches = [
              {
                url = "https://glm53.example.org";
                publicKey = "glm53.example.org-1:AAAA=";
              }
            ];
            gpu = 1;
          };
        }
      )
    ];
  };
  inherit (system) config;
  service = config.systemd.services.glm53;
  unitText = config.systemd.units."glm53.service".text;

  expected = {
    ExecStart = "${lib.getExe packages.serve-fast} --mode exact --max-batch-size 4";
    environment = {
      GLM53_HOST = "::";
      GLM53_PORT = "8000";
      GLM53_MODEL_DIR = "/var/lib/glm53/models/GLM-5.3-Flash-exl3";
      GLM53_MODEL_DOWNLOAD = "1";
      GLM53_MODEL_REPO = "turboderp/GLM-5.3-Flash-exl3";
      GLM53_MODEL_REVISION = "332ab457b709b7ba30dd9a448be5de03b80a7ac9";
      GLM53_VRAM_LIMIT_GB = "22";
      CUDA_VISIBLE_DEVICES = "1";
    };
  };
  problems =
    lib.optional (service.serviceConfig.ExecStart != expected.ExecStart)
      "ExecStart is ${service.serviceConfig.ExecStart}, expected ${expected.ExecStart}"
    ++ lib.concatLists (
      lib.mapAttrsToList (
        name: value:
        lib.optional (
          service.environment.${name} or null != value
        ) "environment.${name} is ${builtins.toJSON (service.environment.${name} or null)}, expected ${value}"
      ) expected.environment
    )
    ++ lib.optional (
      service.serviceConfig.EnvironmentFile or null != "/run/secrets/glm53.env"
    ) "EnvironmentFile is not the option's file"
    ++ lib.optional (!lib.elem 8000 config.networking.firewall.allowedTCPPorts) "port 8000 is not open in the firewall"
    ++ lib.optional (
      !lib.elem "https://glm53.example.org" config.nix.settings.extra-substituters
    ) "the binary cache is not among nix.settings.extra-substituters"
    ++ lib.optional (
      !lib.elem "glm53.example.org-1:AAAA=" config.nix.settings.extra-trusted-public-keys
    ) "the binary cache's key is not among nix.settings.extra-trusted-public-keys"
    # preflight reads the driver's version and the GPU's memory with nvidia-smi
    ++ lib.optional (
      !lib.elem (lib.getBin config.hardware.nvidia.package) service.path
    ) "the driver's nvidia-smi is not on the unit's path"
    ++ lib.optional (
      !lib.elem "ExecStart=${expected.ExecStart}" (lib.splitString "\n" unitText)
    ) "the rendered unit lacks the ExecStart line";
in
assert lib.assertMsg (problems == [ ]) ''
  services.glm53 with every option set:
    ${lib.concatStringsSep "\n  " problems}'';
runCommand "glm53-module-options"
  {
    unit = builtins.unsafeDiscardStringContext unitText;
    passAsFile = [ "unit" ];
    passthru = { inherit config; };
  }
  ''
    cp "$unitPath" $out
  ''
