# nixosModules.fleet: services.glm53-router, several glm53 appliances (each a host with services.glm53) behind
# SGLang's router on one host, with a Valkey there for the replicas' shared Responses store, and nginx in front of the
# router (frontProxy) for the Anthropic Messages API, which the router does not route.
#
# The units are data in nix/lib/router.nix and nix/lib/front-proxy.nix (golden-tested without nixpkgs). On each
# replica set services.glm53.host to an address the router and the front proxy reach,
# services.glm53.environment.GLM53_RESPONSES_STORE_URL to this host's Valkey (redis://router-host:6379/0) and, with a
# key, the same GLM53_API_KEY as the router's apiKeyFile.
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
  cfg = config.services.glm53-router;
  absolutePath = types.strMatching "/.*";

  tls = if cfg.tls.certFile == null then null else { inherit (cfg.tls) certFile keyFile; };
  front = cfg.frontProxy.enable;
  # with the front proxy, nginx takes the clients' address, port and TLS, and the router listens behind it on loopback
  router = import ./lib/router.nix {
    inherit (cfg)
      workers
      metricsPort
      healthIntervalS
      apiKeyFile
      extraArgs
      ;
    exe = lib.getExe cfg.package;
    host = if front then "127.0.0.1" else cfg.host;
    port = if front then cfg.frontProxy.routerPort else cfg.port;
    tls = if front then null else tls;
  };
  frontProxy = import ./lib/front-proxy.nix {
    inherit (cfg)
      workers
      host
      port
      healthIntervalS
      ;
    inherit tls;
    inherit (cfg.frontProxy) routerPort;
    exe = lib.getExe cfg.frontProxy.package;
  };
in
{
  options.services.glm53-router = {
    enable = lib.mkEnableOption "SGLang's router in front of several glm53 replicas";

    package = mkOption {
      type = types.package;
      default = packages.${pkgs.stdenv.hostPlatform.system}.sglang-router;
      defaultText = literalExpression "glm53.packages.\${system}.sglang-router";
      description = "The sglang-router package (the version the fleet tests run).";
    };

    workers = mkOption {
      type = types.nonEmptyListOf (types.strMatching "https?://.+");
      example = [
        "http://10.0.0.11:30000"
        "http://10.0.0.12:30000"
      ];
      description = ''
        The replicas' base URLs. The router checks each one's `/health` and reads its `/server_info` and
        `/model_info` (the served name becomes the model id it lists at its own `/v1/models`).
      '';
    };

    host = mkOption {
      type = types.str;
      default = "127.0.0.1";
      example = "0.0.0.0";
      description = "Address the fleet listens on for clients (the front proxy's, or the router's without it).";
    };

    port = mkOption {
      type = types.port;
      default = 30000;
      description = "Port the fleet listens on for clients (the front proxy's, or the router's without it).";
    };

    metricsPort = mkOption {
      type = types.port;
      default = 29000;
      description = "Port of the router's Prometheus metrics, on loopback.";
    };

    healthIntervalS = mkOption {
      type = types.ints.positive;
      default = 2;
      description = ''
        Seconds between two health checks of a replica. One failed check takes a replica out of rotation (a draining
        replica answers 503 on `/health`), one passed check puts it back.
      '';
    };

    tls = {
      certFile = mkOption {
        type = types.nullOr absolutePath;
        default = null;
        example = "/var/lib/acme/llm.example.org/fullchain.pem";
        description = "PEM certificate for HTTPS to the clients, read through systemd's LoadCredential. `null`: plain HTTP.";
      };
      keyFile = mkOption {
        type = types.nullOr absolutePath;
        default = null;
        example = "/var/lib/acme/llm.example.org/key.pem";
        description = "PEM private key of `tls.certFile`. `null` when `tls.certFile` is.";
      };
    };

    apiKeyFile = mkOption {
      type = types.nullOr absolutePath;
      default = null;
      example = "/run/secrets/glm53-api-key";
      description = ''
        File holding the fleet's API key. The router then demands it of every client (`Authorization: Bearer`) and
        presents it to the replicas, which must have the same `GLM53_API_KEY`. What the front proxy sends straight to a
        replica (`/v1/messages`) carries the client's own key (`x-api-key` or `Authorization`), which the replica
        checks. `null`: no key.
      '';
    };

    valkey = {
      enable = mkOption {
        type = types.bool;
        default = true;
        description = ''
          Run Valkey on this host for the replicas' shared Responses store (`previous_response_id` continues on any
          replica, and survives a replica's restart). Each replica points `GLM53_RESPONSES_STORE_URL` at it.
        '';
      };
      bind = mkOption {
        type = types.str;
        default = "127.0.0.1";
        example = "10.0.0.10";
        description = "Address Valkey listens on: one the replicas reach (a private network: Valkey has no TLS here).";
      };
      port = mkOption {
        type = types.port;
        default = 6379;
        description = "Valkey's port.";
      };
    };

    frontProxy = {
      enable = mkOption {
        type = types.bool;
        default = true;
        description = ''
          Run nginx in front of the router, on `host`:`port` with `tls`: Anthropic Messages (`/v1/messages`, which
          sglang-router does not route) goes straight to the replicas by a consistent hash of Claude Code's
          `X-Claude-Code-Session-Id` header (a client without it: of its address), a draining replica's 503 retried
          on the next; everything else goes to the router, which then listens on loopback at `routerPort`. nginx's
          health checks are passive: a replica that fails one request is left out for `healthIntervalS`. The API key
          passes through to the router or the replica, which check it. `false`: the router alone on `host`:`port`.
        '';
      };
      package = mkOption {
        type = types.package;
        default = pkgs.nginx;
        defaultText = literalExpression "pkgs.nginx";
        description = "The nginx package.";
      };
      routerPort = mkOption {
        type = types.port;
        default = 30001;
        description = "Port the router listens on, on loopback, behind the front proxy.";
      };
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open `port` in the firewall (Valkey's port stays closed: open it for the replicas' network yourself).";
    };

    extraArgs = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [
        "--request-timeout-secs"
        "3600"
      ];
      description = "More sglang-router flags, after the module's (a repeated flag's last value wins).";
    };
  };

  config = lib.mkIf cfg.enable {
    assertions = [
      {
        assertion = (cfg.tls.certFile == null) == (cfg.tls.keyFile == null);
        message = "services.glm53-router.tls needs both certFile and keyFile, or neither";
      }
      {
        assertion = front -> lib.all (lib.hasPrefix "http://") cfg.workers;
        message = "services.glm53-router.frontProxy reaches the workers over plain HTTP: list them as http://host:port";
      }
    ];

    systemd.services.glm53-router = router.service;
    systemd.services.glm53-front-proxy = lib.mkIf front (
      frontProxy.service // { restartTriggers = [ frontProxy.config ]; }
    );
    environment.etc = lib.mkIf front { ${frontProxy.configPath}.text = frontProxy.config; };

    # nixpkgs' Redis module runs Valkey as well (one package for every server of the host)
    services.redis.package = lib.mkIf cfg.valkey.enable pkgs.valkey;
    services.redis.servers.glm53 = lib.mkIf cfg.valkey.enable {
      enable = true;
      inherit (cfg.valkey) bind port;
      # the store is a cache of conversations: nothing to persist across a reboot of the router host
      save = [ ];
      settings.protected-mode = "no";
    };

    networking.firewall = lib.mkIf cfg.openFirewall { allowedTCPPorts = [ cfg.port ]; };
  };
}
