# The fleet's front proxy as plain data: nginx with nix/lib/front-proxy.conf filled in (that file's comments say why
# each setting). It takes the clients' address, port and TLS: Anthropic Messages (/v1/messages) goes straight to the
# boxes by a consistent hash of Claude Code's session header, everything else to the router behind it on loopback.
# nix/fleet.nix assigns `service` to systemd.services.glm53-front-proxy and writes `config` to /etc/`configPath`;
# bench/fleet.py fills the same template for the fleet tests.
#
# Builtins only, so the golden tests (nix/tests/golden.nix) pin the configuration and the unit down without nixpkgs.
{
  # the nginx program
  exe,
  # the boxes, as URLs: "http://10.0.0.11:30000" (nginx reaches them over plain HTTP)
  workers,
  host ? "127.0.0.1",
  port ? 30000,
  # the router's port on loopback
  routerPort ? 30001,
  # a box that failed one attempt is left out for this long, as the router leaves it out until its next check
  healthIntervalS ? 2,
  # null: plain HTTP; else { certFile; keyFile; } for HTTPS to the clients
  tls ? null,
}:
let
  inherit (builtins)
    concatStringsSep
    elemAt
    length
    match
    readFile
    replaceStrings
    ;

  name = "glm53-front-proxy";
  runtimeDir = "/run/${name}";
  sandbox = import ./sandbox.nix;
  credential = file: "/run/credentials/${name}.service/${file}";

  address =
    url:
    let
      parts = match "http://([^/]+)/?" url;
    in
    if parts == null then
      throw "the front proxy reaches the boxes over plain HTTP (http://host:port), not ${url}"
    else
      elemAt parts 0;

  listen =
    if tls == null then
      "listen ${host}:${toString port};"
    else
      "listen ${host}:${toString port} ssl; ssl_certificate ${credential "tls-cert"}; ssl_certificate_key ${credential "tls-key"};";

  config =
    replaceStrings
      [ "@LISTEN@" "@BOXES@" "@ROUTER@" "@RUNTIME@" ]
      [
        listen
        (concatStringsSep " " (
          map (w: "server ${address w} max_fails=1 fail_timeout=${toString healthIntervalS}s;") workers
        ))
        "127.0.0.1:${toString routerPort}"
        runtimeDir
      ]
      (readFile ./front-proxy.conf);
  # in /etc, not the store: the unit stays the same text when the configuration changes (the module restarts it then)
  configPath = "glm53/front-proxy.conf";
in
assert length workers > 0;
{
  inherit config configPath;
  service = {
    description = "glm53 fleet front proxy: nginx, /v1/messages to ${toString (length workers)} glm53 replicas, the rest to the router";
    wantedBy = [ "multi-user.target" ];
    after = [ "network-online.target" ];
    wants = [ "network-online.target" ];

    serviceConfig = sandbox // {
      Type = "exec";
      ExecStart = "${exe} -e stderr -c /etc/${configPath}";
      # nginx's graceful stop: it closes the listeners and lets the answers in flight (streams too) end
      KillSignal = "SIGQUIT";
      TimeoutStopSec = "30s";
      Restart = "always";
      RestartSec = "2s";
      LoadCredential = if tls == null then [ ] else [ "tls-cert:${tls.certFile}" "tls-key:${tls.keyFile}" ];
      RuntimeDirectory = name;
      # a port below 1024 (443) without root; a private user namespace would leave the capability behind in it
      AmbientCapabilities = [ "CAP_NET_BIND_SERVICE" ];
      CapabilityBoundingSet = [ "CAP_NET_BIND_SERVICE" ];
      PrivateUsers = false;
    };
  };
}
