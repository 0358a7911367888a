# The systemd service of the server, as plain data: nix/module.nix turns the NixOS options into these arguments and
# assigns `service` to systemd.services.glm53.
#
# Builtins only, so the golden tests (nix/tests/golden.nix) pin down the unit without nixpkgs. Every server setting
# travels as a GLM53_* variable (glm53/config.py reads them; an unknown one stops the start) and ExecStart carries
# only `--mode` and extraArgs, so an extra argument overrides the module's value: the server takes the last value
# of a repeated flag and flags win over the environment.
{
  mode,
  # the serve-fast or serve-exact program
  exe,
  # the readiness probe: polls the URL it is given until it answers 200
  waitHealthy,
  host ? "127.0.0.1",
  port ? 30000,
  # null: the server's default, $GLM53_ROOT/models/GLM-5.3-Flash-exl3
  modelDir ? null,
  download ? false,
  # null: the server's pinned repository and revision
  repo ? null,
  revision ? null,
  extraArgs ? [ ],
  environment ? { },
  environmentFile ? null,
  # null: every GPU the driver exposes is visible
  gpu ? 0,
}:
let
  inherit (builtins)
    concatStringsSep
    elem
    isString
    match
    replaceStrings
    ;

  sandbox = import ./sandbox.nix;
  name = "glm53";
  stateDir = "/var/lib/${name}";
  cacheDir = "/var/cache/${name}";

  execArg = import ./exec-arg.nix;

  # Where the probe reaches the server: a wildcard address is reached through loopback, and an IPv6 literal needs
  # brackets in a URL.
  probeHost =
    if host == "0.0.0.0" then
      "127.0.0.1"
    else if elem host [ "::" "[::]" ] then
      "[::1]"
    else if match ".*:.*" host != null && builtins.substring 0 1 host != "[" then
      "[${host}]"
    else
      host;
  healthUrl = "http://${probeHost}:${toString port}/health";

  optionalAttr = cond: attrs: if cond then attrs else { };
in
assert elem mode [
  "fast"
  "exact"
];
assert builtins.all isString extraArgs;
{
  inherit healthUrl;

  # systemd.services.glm53
  service = {
    description = "glm53: GLM-5.3-Flash behind an OpenAI-compatible API (${mode} mode)";
    wantedBy = [ "multi-user.target" ];
    # nvidia-persistenced keeps the driver initialised between clients; ordering after it costs nothing on a host
    # that does not run it.
    after = [
      (if download then "network-online.target" else "network.target")
      "nvidia-persistenced.service"
    ];
    wants = if download then [ "network-online.target" ] else [ ];

    environment = {
      GLM53_HOST = host;
      GLM53_PORT = toString port;
      GLM53_ROOT = stateDir;
      GLM53_MODEL_DOWNLOAD = if download then "1" else "0";
      HOME = stateDir;
      XDG_CACHE_HOME = cacheDir;
      # Compiled kernels are cached on a path that allows exec: Triton dlopen()s the launchers it builds.
      TRITON_CACHE_DIR = "${cacheDir}/triton";
      TORCHINDUCTOR_CACHE_DIR = "${cacheDir}/inductor";
      CUDA_CACHE_PATH = "${cacheDir}/nv";
    }
    // optionalAttr (modelDir != null) { GLM53_MODEL_DIR = modelDir; }
    // optionalAttr (repo != null) { GLM53_MODEL_REPO = repo; }
    // optionalAttr (revision != null) { GLM53_MODEL_REVISION = revision; }
    // optionalAttr (gpu != null) {
      # CUDA numbers devices fastest first unless told otherwise; bus order matches nvidia-smi's indices.
      CUDA_DEVICE_ORDER = "PCI_BUS_ID";
      CUDA_VISIBLE_DEVICES = toString gpu;
    }
    // environment;

    # the project's service sandbox (./sandbox.nix), opened where a GPU server needs more (each override says why)
    serviceConfig = sandbox // {
      Type = "exec";
      ExecStart = concatStringsSep " " (
        map execArg (
          [
            exe
            "--mode"
            mode
          ]
          ++ extraArgs
        )
      );
      # The unit turns active only when /health answers 200: the model loads after the port opens (503 until then).
      ExecStartPost = "${execArg waitHealthy} ${execArg healthUrl}";
      # Loading 125 GB from a local disk takes minutes; a first download takes as long as the network does.
      TimeoutStartSec = if download then "infinity" else "30min";
      # gunicorn stops gracefully on SIGTERM and gives streams 30 s to finish.
      TimeoutStopSec = "45s";
      Restart = "on-failure";
      RestartSec = "30s";
      # Exit status 2 is a setting the server refuses; retrying cannot fix it.
      RestartPreventExitStatus = "2";

      StateDirectory = name;
      StateDirectoryMode = "0700";
      CacheDirectory = name;
      CacheDirectoryMode = "0700";
      WorkingDirectory = stateDir;
      # Every routed expert lives once in page-locked host RAM (cudaHostRegister/mlock); the default 8 MB limit
      # would make pinning fail.
      LimitMEMLOCK = "infinity";
      LimitNOFILE = 65536;

      # GPU access. PrivateDevices would hide the NVIDIA device nodes, so the device list is closed instead.
      PrivateDevices = false;
      DevicePolicy = "closed";
      DeviceAllow = [
        "char-nvidiactl"
        "char-nvidia-frontend"
        "char-nvidia-uvm"
        "char-nvidia-caps"
      ];

      # torch (oneDNN's JIT) and Triton write machine code and then execute it: W^X would make them fail.
      MemoryDenyWriteExecute = false;
      # torch reads /proc/cpuinfo and /proc/meminfo, which ProcSubset=pid would hide.
      ProcSubset = "all";
      # @resources holds mbind/set_mempolicy and sched_setaffinity, which the CPU tier uses to place its threads.
      SystemCallFilter = [
        "@system-service"
        "@resources"
        "~@privileged"
      ];
    }
    // optionalAttr (environmentFile != null) { EnvironmentFile = environmentFile; };
  };
}
