# checks.fleet-options: services.glm53-router in a small NixOS configuration with every option away from its default,
# evaluated with nixpkgs' module system and systemd unit generation, as checks.module-options does for services.glm53.
# Evaluating it asserts that each option reaches the router's unit, the front proxy's, Valkey or the firewall; building
# it writes the rendered units. With the front proxy (on by default) nginx takes the port and TLS, and the router
# listens on loopback behind it.
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
      {
        system.stateVersion = "26.05";
        nixpkgs.hostPlatform = "x86_64-linux";
        boot.loader.grub.enable = false;
        fileSystems."/" = {
          device = "/dev/disk/by-label/nixos";
          fsType = "ext4";
        };
        services.glm53-router = {
          enable = true;
          package = packages.sglang-router;
          workers = [
            "http://10.0.0.11:30000"
            "http://10.0.0.12:30000"
          ];
          host = "0.0.0.0";
          port = 443;
          metricsPort = 29100;
          healthIntervalS = 3;
          tls = {
            certFile = "/var/lib/acme/llm/fullchain.pem";
            keyFile = "/var/lib/acme/llm/key.pem";
          };
          apiKeyFile = "/run/secrets/glm53-api-key";
          valkey = {
            bind = "10.0.0.10";
            port = 6380;
          };
          frontProxy.routerPort = 30100;
          openFirewall = true;
          extraArgs = [
            "--request-timeout-secs"
            "3600"
          ];
        };
      }
    ];
  };
  inherit (system) config;
  service = config.systemd.services.glm53-router;
  exec = service.serviceConfig.ExecStart;
  front = config.systemd.services.glm53-front-proxy.serviceConfig;
  frontConfig = config.environment.etc."glm53/front-proxy.conf".text;
  valkey = config.services.redis.servers.glm53;
  problems =
    lib.concatMap (flag: lib.optional (!lib.hasInfix flag exec) "ExecStart lacks ${flag}: ${exec}") [
      "'--worker-urls' 'http://10.0.0.11:30000' 'http://10.0.0.12:30000'"
      "'--host' '127.0.0.1' '--port' '30100'"
      "'--prometheus-port' '29100'"
      "'--health-check-interval-secs' '3'"
      "'--request-timeout-secs' '3600'"
      "--api-key"
    ]
    ++ lib.optional (lib.hasInfix "--tls-cert-path" exec) "the router behind the front proxy has TLS: ${exec}"
    ++ lib.optional (
      service.serviceConfig.LoadCredential != [ "api-key:/run/secrets/glm53-api-key" ]
    ) "the router's LoadCredential is ${builtins.toJSON service.serviceConfig.LoadCredential}"
    ++ lib.optional (
      front.LoadCredential != [
        "tls-cert:/var/lib/acme/llm/fullchain.pem"
        "tls-key:/var/lib/acme/llm/key.pem"
      ]
    ) "the front proxy's LoadCredential is ${builtins.toJSON front.LoadCredential}"
    ++ lib.concatMap (line: lib.optional (!lib.hasInfix line frontConfig) "the front proxy's nginx.conf lacks ${line}") [
      "listen 0.0.0.0:443 ssl;"
      "server 10.0.0.11:30000 max_fails=1 fail_timeout=3s; server 10.0.0.12:30000 max_fails=1 fail_timeout=3s;"
      "server 127.0.0.1:30100;"
    ]
    ++ lib.optional (
      front.ExecStart != "${lib.getExe config.services.glm53-router.frontProxy.package} -e stderr -c /etc/glm53/front-proxy.conf"
    ) "the front proxy runs ${front.ExecStart}"
    ++ lib.optional (!(valkey.enable && valkey.port == 6380 && valkey.bind == "10.0.0.10")) "Valkey is not on 10.0.0.10:6380"
    ++ lib.optional (config.services.redis.package.pname != "valkey") "the store runs ${config.services.redis.package.pname}, not Valkey"
    ++ lib.optional (!lib.elem 443 config.networking.firewall.allowedTCPPorts) "port 443 is not open in the firewall"
    ++ lib.optional (lib.elem 6380 config.networking.firewall.allowedTCPPorts) "Valkey's port is open in the firewall";
  unitText = config.systemd.units."glm53-router.service".text + config.systemd.units."glm53-front-proxy.service".text;
in
assert lib.assertMsg (problems == [ ]) ''
  services.glm53-router with every option set:
    ${lib.concatStringsSep "\n  " problems}'';
runCommand "glm53-fleet-options"
  {
    unit = builtins.unsafeDiscardStringContext unitText;
    passAsFile = [ "unit" ];
    passthru = { inherit config; };
  }
  ''
    cp "$unitPath" $out
  ''
