# The fleet's router as plain data: SGLang's router (sglang-router) in front of several glm53 replicas. nix/fleet.nix
# turns the NixOS options into these arguments and assigns `service` to systemd.services.glm53-router.
#
# Builtins only, so the golden tests (nix/tests/golden.nix) pin the unit down without nixpkgs. The flags are those of
# bench/fleet.py's router_flags, which the fleet tests run: cache-aware routing over a prefix tree of the requests'
# text (an agent's next turn goes where its conversation is cached), health checks on /health (a draining replica
# answers 503 there and leaves the rotation), a circuit breaker that opens on the first failed request and retries of
# 408, 429 and 5xx answers on another replica (a draining replica's 503 is retried, not returned).
{
  # the sglang-router program (its Python launcher)
  exe,
  # the replicas, as URLs: "http://10.0.0.11:30000"
  workers,
  host ? "127.0.0.1",
  port ? 30000,
  metricsPort ? 29000,
  healthIntervalS ? 2,
  # null: plain HTTP; else { certFile; keyFile; } for HTTPS to the clients
  tls ? null,
  # null: no key; else a file holding the fleet's API key, which the router demands of clients (Authorization:
  # Bearer) and presents to the replicas
  apiKeyFile ? null,
  extraArgs ? [ ],
}:
let
  inherit (builtins) concatStringsSep isString length;

  name = "glm53-router";
  execArg = import ./exec-arg.nix;
  sandbox = import ./sandbox.nix;
  # one word for the shell: single-quoted, so it expands nothing
  shellArg = arg: "'" + builtins.replaceStrings [ "'" ] [ "'\\''" ] arg + "'";
  # where systemd puts the unit's LoadCredential files ($CREDENTIALS_DIRECTORY)
  credential = file: "/run/credentials/${name}.service/${file}";

  flags =
    [
      "launch"
      "--host"
      host
      "--port"
      (toString port)
      "--worker-urls"
    ]
    ++ workers
    ++ [
      "--policy"
      "cache_aware"
      "--health-check-endpoint"
      "/health"
      "--health-check-interval-secs"
      (toString healthIntervalS)
      "--health-failure-threshold"
      "1"
      "--health-success-threshold"
      "1"
      "--cb-failure-threshold"
      "1"
      "--cb-success-threshold"
      "1"
      "--cb-timeout-duration-secs"
      (toString healthIntervalS)
      "--retry-max-retries"
      "5"
      "--prometheus-host"
      "127.0.0.1"
      "--prometheus-port"
      (toString metricsPort)
    ]
    ++ (
      if tls == null then
        [ ]
      else
        [
          "--tls-cert-path"
          (credential "tls-cert")
          "--tls-key-path"
          (credential "tls-key")
        ]
    )
    ++ extraArgs;

  credentials =
    (if tls == null then [ ] else [ "tls-cert:${tls.certFile}" "tls-key:${tls.keyFile}" ])
    ++ (if apiKeyFile == null then [ ] else [ "api-key:${apiKeyFile}" ]);
in
assert length workers > 0;
assert builtins.all isString (workers ++ extraArgs);
{
  service = {
    description = "glm53 fleet router: sglang-router over ${toString (length workers)} glm53 replicas";
    wantedBy = [ "multi-user.target" ];
    after = [ "network-online.target" ];
    wants = [ "network-online.target" ];

    serviceConfig = sandbox // {
      Type = "exec";
      # sglang-router takes the key only as a flag: a shell reads it from the credential at start, so it stays out of
      # the world-readable store and the unit (it does show in the running router's command line).
      ExecStart =
        let
          words = map execArg ([ exe ] ++ flags);
        in
        if apiKeyFile == null then
          concatStringsSep " " words
        else
          # execArg turns each $ into $$, a literal $ to systemd: the shell is what expands them
          "/bin/sh -c ${execArg "exec ${concatStringsSep " " (map shellArg ([ exe ] ++ flags))} --api-key \"$(cat \"$CREDENTIALS_DIRECTORY/api-key\")\""}";
      LoadCredential = credentials;
      # The router has no state of its own worth a drain: requests in flight end with the connection.
      TimeoutStopSec = "30s";
      Restart = "always";
      RestartSec = "2s";
    };
  };
}
