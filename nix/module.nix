# nixosModules.default: services.glm53, the server as a hardened systemd service on a host with an NVIDIA GPU.
#
# The unit itself is data in nix/lib/unit.nix (golden-tested without nixpkgs); this file declares the options and
# hands them over. The host chooses and configures the NVIDIA driver: the module only warns when there is none, or
# when it is older than CUDA 13.2's own branch (nix/lib/driver.nix).
{
  # the flake's `packages` output, for the default of `package`
  packages,
}:
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib) literalExpression mkOption types;
  cfg = config.services.glm53;

  # Strings, not Nix paths: a path literal would be copied into the world-readable store, which is wrong for a
  # 125 GB model and for a file of secrets.
  absolutePath = types.strMatching "/.*";

  waitHealthy = pkgs.writeShellScript "glm53-wait-healthy" ''
    # Run as ExecStartPost: returns once the server's /health answers 200, or fails when the server has exited.
    url=$1
    until ${lib.getExe pkgs.curl} --silent --fail --output /dev/null --max-time 5 "$url"; do
      if ! kill -0 "$MAINPID" 2>/dev/null; then
        echo "glm53 exited before $url answered 200" >&2
        exit 1
      fi
      ${pkgs.coreutils}/bin/sleep 2
    done
  '';

  unit = import ./lib/unit.nix {
    inherit (cfg)
      mode
      host
      port
      modelDir
      download
      repo
      revision
      extraArgs
      environment
      environmentFile
      gpu
      ;
    exe = lib.getExe cfg.package;
    waitHealthy = "${waitHealthy}";
  };

  hasNvidiaDriver =
    lib.elem "nvidia" config.services.xserver.videoDrivers || config.hardware.nvidia.datacenter.enable;
  driver = import ./lib/driver.nix;
  driverVersion = config.hardware.nvidia.package.version;
in
{
  options.services.glm53 = {
    enable = lib.mkEnableOption "glm53, GLM-5.3-Flash on one NVIDIA GPU plus host RAM behind an OpenAI-compatible API";

    mode = mkOption {
      type = types.enum [
        "fast"
        "exact"
      ];
      default = "fast";
      description = ''
        `fast` adds the CPU tier, which computes the coldest decode misses on host cores; `exact` gives output
        bit-identical to stock exllamav3. Passed to the server as `--mode`, so it holds whichever package runs.
      '';
    };

    package = mkOption {
      type = types.package;
      default = packages.${pkgs.stdenv.hostPlatform.system}."serve-${cfg.mode}";
      defaultText = literalExpression ''glm53.packages.''${pkgs.stdenv.hostPlatform.system}."serve-''${config.services.glm53.mode}"'';
      description = ''
        The server program: serve-fast or serve-exact from this flake, built against its pinned nixpkgs. The
        default follows `mode` (mkPackageOption cannot express that). Its `meta.mainProgram` is started.
      '';
    };

    host = mkOption {
      type = types.str;
      default = "127.0.0.1";
      example = "0.0.0.0";
      description = "Address to listen on. Loopback by default; use `0.0.0.0` or `::` to serve other machines.";
    };

    port = mkOption {
      type = types.port;
      default = 30000;
      description = "TCP port to listen on.";
    };

    modelDir = mkOption {
      type = types.nullOr absolutePath;
      default = null;
      example = "/srv/models/GLM-5.3-Flash-exl3";
      description = ''
        The EXL3 checkpoint to serve. `null`: the server's default,
        `/var/lib/glm53/models/GLM-5.3-Flash-exl3` (under the service's state directory). A directory elsewhere
        must be readable by any user (the service runs as a dynamic user), must not be under /home (hidden from
        the unit) and cannot be downloaded into.
      '';
    };

    download = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Download the checkpoint (125 GB) into `modelDir` when it holds no `config.json`. The unit then waits for
        the network, and its start has no time limit while the download runs.
      '';
    };

    repo = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "turboderp/GLM-5.3-Flash-exl3";
      description = "Model hub repository to download from. `null`: the server's pinned default.";
    };

    revision = mkOption {
      type = types.nullOr types.str;
      default = null;
      description = "Revision of `repo` to download. `null`: the server's pinned default.";
    };

    extraArgs = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [
        "--max-batch-size"
        "4"
      ];
      description = ''
        Arguments appended to the server's command line. The server takes the last value of a repeated flag,
        and flags win over the environment, so these override every other option here.
      '';
    };

    environment = mkOption {
      type = types.attrsOf types.str;
      default = { };
      example = {
        GLM53_VRAM_LIMIT_GB = "22";
      };
      description = ''
        Environment of the service, added to (and overriding) the one the module sets. The server refuses an
        unknown `GLM53_*` variable at start, naming it.
      '';
    };

    environmentFile = mkOption {
      type = types.nullOr absolutePath;
      default = null;
      example = "/run/secrets/glm53.env";
      description = ''
        A file of `NAME=value` lines read by systemd as root before the start, for secrets such as
        `GLM53_API_KEY` (every endpoint but /health then requires `Authorization: Bearer <key>`). `null`: none.
      '';
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open `port` in the firewall.";
    };

    binaryCaches = mkOption {
      type = types.listOf (
        types.submodule {
          options = {
            url = mkOption {
              type = types.str;
              example = "https://glm53.cachix.org";
              description = "The cache's URL, as Nix's `substituters` setting takes it.";
            };
            publicKey = mkOption {
              type = types.str;
              example = "glm53.cachix.org-1:AAAA...=";
              description = "The key the cache signs with, as Nix's `trusted-public-keys` setting takes it.";
            };
          };
        }
      );
      default = [ ];
      description = ''
        Binary caches that hold this flake's builds, added to the host's `nix.settings` (`extra-substituters`,
        `extra-trusted-public-keys`). No public cache holds them (custom CUDA capabilities, the pinned wheels), so a
        host that rebuilds without one compiles exllamav3's kernels itself; push a release builder's store paths to a
        cache of your own (Cachix, attic, `nix copy --to`) and list it here. `[ ]`: none beyond the host's own.
      '';
    };

    gpu = mkOption {
      type = types.nullOr types.ints.unsigned;
      default = 0;
      description = ''
        Index of the GPU to use, in PCI bus order (as `nvidia-smi` numbers them). `null`: every GPU the driver
        exposes is visible and the server uses the first.
      '';
    };
  };

  config = lib.mkIf cfg.enable {
    assertions = [
      {
        # The service runs as a dynamic user, whose only writable places are its state and cache directories.
        assertion = cfg.download -> cfg.modelDir == null || lib.hasPrefix "/var/lib/glm53/" cfg.modelDir;
        message = "services.glm53.download writes into modelDir, which must then lie under /var/lib/glm53 (or be null)";
      }
    ];

    warnings =
      if !hasNvidiaDriver then
        [
          ''
            services.glm53 is enabled but this host configures no NVIDIA driver, so only the CPU demo engine
            (--engine tiny) can run. The module does not choose a driver: set services.xserver.videoDrivers = [ "nvidia" ]
            (also on headless hosts), hardware.nvidia.open and a hardware.nvidia.package of the ${driver.full} series or
            newer (CUDA 13.2's own; the ${driver.minimum} series runs it with limits).
          ''
        ]
      else
        lib.optional (driver.support driverVersion != "full") ''
          services.glm53 runs CUDA 13.2, and this host's NVIDIA driver ${driverVersion} is older than the ${driver.full}
          series that supports it fully. ${
            if driver.support driverVersion == "compatibility" then
              "Minor-version compatibility runs the server's machine code, but GPUs outside the build's capabilities fail and so do CUDA calls added after 13.0."
            else
              "It cannot run CUDA 13 at all (the oldest that can is the ${driver.minimum} series); the server will refuse to start."
          } Set hardware.nvidia.package to a driver of the ${driver.full} series or newer.
        '';

    systemd.services.glm53 = lib.mkMerge [
      unit.service
      # preflight reads the driver's version and the GPU's memory with nvidia-smi, which the driver package holds
      { path = lib.optional hasNvidiaDriver (lib.getBin config.hardware.nvidia.package); }
    ];

    networking.firewall = lib.mkIf cfg.openFirewall { allowedTCPPorts = [ cfg.port ]; };

    nix.settings = lib.mkIf (cfg.binaryCaches != [ ]) {
      extra-substituters = map (c: c.url) cfg.binaryCaches;
      extra-trusted-public-keys = map (c: c.publicKey) cfg.binaryCaches;
    };
  };
}
