# Golden tests of the project's own Nix logic (nix/lib), builtins only, so they run where nixpkgs cannot be had.
#
#   cases.NAME     what the logic produces for one input
#   failures       every difference between cases.NAME and nix/tests/golden/NAME.json, as "NAME.path: ..." lines
#
# nix/ci/check.sh evaluates `failures`; `nix/ci/check.sh --update-golden` rewrites the JSON files from `cases`
# (review the diff: it is the change in behaviour).
let
  inherit (builtins)
    attrNames
    concatLists
    concatMap
    elemAt
    fromJSON
    genList
    isAttrs
    isList
    length
    pathExists
    readFile
    toJSON
    tryEval
    ;

  unit = import ../lib/unit.nix;
  router = import ../lib/router.nix;
  frontProxy = import ../lib/front-proxy.nix;
  image = import ../lib/image.nix;
  wrapper = import ../lib/wrapper.nix;
  cuda = import ../lib/cuda.nix;
  mounts = import ../lib/mounts.nix;
  torchCuda = import ../lib/torch-cuda.nix;
  driver = import ../lib/driver.nix;
  torchCudaRecord = fromJSON (readFile ../pins/torch-cuda.json);
  realPins = import ../lib/pins.nix { };
  pins = file: import ../lib/pins.nix { inherit file; };

  # Stand-ins for store paths: the logic only places them.
  exe = mode: "/nix/store/00000000000000000000000000000000-serve-${mode}-0.1.0/bin/serve-${mode}";
  waitHealthy = "/nix/store/00000000000000000000000000000000-glm53-wait-healthy";

  # Fails to evaluate (a throw or a failed assert), once forced completely.
  rejects = value: !(tryEval (builtins.deepSeq value value)).success;

  fixture = ./fixtures/pins.json;
  # A copy of the fixture with one field of one pin replaced, as a file pins.nix can read.
  brokenPins =
    name: field: value:
    let
      data = fromJSON (readFile fixture);
    in
    builtins.toFile "pins-${name}-${field}.json" (
      toJSON (data // { packages = data.packages // { ${name} = data.packages.${name} // { ${field} = value; }; }; })
    );

  applianceMounts = import ../../appliance/mounts.nix;

  routerExe = "/nix/store/00000000000000000000000000000000-python3.13-sglang-router-0.3.2/bin/sglang-router";
  nginxExe = "/nix/store/00000000000000000000000000000000-nginx-1.28.0/bin/nginx";

  cases = {
    # The fleet's router with the fleet module's defaults.
    router-default = router {
      exe = routerExe;
      workers = [
        "http://10.0.0.11:30000"
        "http://10.0.0.12:30000"
      ];
    };
    # HTTPS to the clients and an API key, read from credentials; a flag systemd would otherwise misread.
    router-tls-key = router {
      exe = routerExe;
      workers = [
        "http://10.0.0.11:30000"
        "http://10.0.0.12:30000"
        "http://10.0.0.13:30000"
      ];
      host = "0.0.0.0";
      port = 443;
      healthIntervalS = 5;
      tls = {
        certFile = "/var/lib/acme/llm/fullchain.pem";
        keyFile = "/var/lib/acme/llm/key.pem";
      };
      apiKeyFile = "/run/secrets/glm53 key";
      extraArgs = [
        "--request-id-headers"
        "x-request-id $HOME 100%"
      ];
    };
    # The front proxy with the fleet module's defaults: nginx's whole configuration and its unit.
    front-proxy-default = frontProxy {
      exe = nginxExe;
      workers = [
        "http://10.0.0.11:30000"
        "http://10.0.0.12:30000"
      ];
    };
    # HTTPS to the clients from credentials, on a port below 1024, a longer health interval.
    front-proxy-tls = frontProxy {
      exe = nginxExe;
      workers = [
        "http://10.0.0.11:30000"
        "http://10.0.0.12:30000"
        "http://10.0.0.13:30000/"
      ];
      host = "0.0.0.0";
      port = 443;
      routerPort = 30100;
      healthIntervalS = 5;
      tls = {
        certFile = "/var/lib/acme/llm/fullchain.pem";
        keyFile = "/var/lib/acme/llm/key.pem";
      };
    };
    # An https:// worker: nginx's upstream is plain HTTP.
    front-proxy-https-worker = rejects (frontProxy {
      exe = nginxExe;
      workers = [ "https://10.0.0.11:30000" ];
    });
    # The defaults of the NixOS module.
    unit-fast = unit {
      mode = "fast";
      exe = exe "fast";
      inherit waitHealthy;
    };
    # Every option away from its default, including arguments systemd would otherwise misread.
    unit-exact = unit {
      mode = "exact";
      exe = exe "exact";
      inherit waitHealthy;
      host = "::";
      port = 8000;
      modelDir = "/var/lib/glm53/models/GLM-5.3-Flash-exl3-3.05bpw";
      download = true;
      repo = "turboderp/GLM-5.3-Flash-exl3";
      revision = "332ab457b709b7ba30dd9a448be5de03b80a7ac9";
      extraArgs = [
        "--served-name"
        "glm 5.3 \"flash\""
        "--ct-cpus"
        "2-11,14"
        "--triton-pin"
        "/srv/pins/100%$HOME.json"
      ];
      environment = {
        GLM53_VRAM_LIMIT_GB = "22";
      };
      environmentFile = "/run/secrets/glm53.env";
      gpu = null;
    };
    unit-probe-hosts = map (host: (unit {
      mode = "fast";
      exe = exe "fast";
      inherit waitHealthy host;
    }).healthUrl) [
      "127.0.0.1"
      "0.0.0.0"
      "::"
      "fd00::1"
      "[fd00::1]"
      "gpu-host.lan"
    ];

    image-fast = image {
      mode = "fast";
      version = "0.1.0";
      entrypoint = exe "fast";
      caBundle = "/nix/store/00000000000000000000000000000000-nss-cacert/etc/ssl/certs/ca-bundle.crt";
    };
    image-exact = image {
      mode = "exact";
      version = "0.1.0";
      entrypoint = exe "exact";
      caBundle = "/nix/store/00000000000000000000000000000000-nss-cacert/etc/ssl/certs/ca-bundle.crt";
    };

    wrapper-fast = wrapper {
      mode = "fast";
      cc = "/nix/store/00000000000000000000000000000000-gcc-wrapper/bin/cc";
    };
    wrapper-exact = wrapper {
      mode = "exact";
      cc = "/nix/store/00000000000000000000000000000000-gcc-wrapper/bin/cc";
    };

    # Three real pins (hashes as PyPI lists them), read the way the wheel builder and CI's fetch tier read them.
    pins-fixture = (pins fixture).packages;
    pins-rejects = {
      url-elsewhere = rejects (pins (brokenPins "packaging" "url" "https://example.org/packaging-26.4-py3-none-any.whl"));
      url-other-file = rejects (pins (brokenPins "packaging" "filename" "packaging-26.3-py3-none-any.whl"));
      hex-truncated = rejects (pins (brokenPins "packaging" "sha256" "ba7b5504"));
      sri-of-another-file = rejects (pins (brokenPins "markupsafe" "hash" (pins fixture).packages.packaging.hash));
      dependency-unpinned = rejects (pins (brokenPins "jinja2" "deps" [ "markupsafe" "babel" ]));
      not-a-wheel = rejects (pins (brokenPins "packaging" "filename" "packaging-26.4.tar.gz"));
    };

    # How checks.appliance-mounts tells an evaluated `fileSystems` from the appliance's own (appliance/mounts.nix): the
    # check itself runs on the evaluated toplevel and disk image (nix/ci/check.sh's eval tier).
    mounts-missing = {
      # what nixpkgs' disk-image module defines alone
      image-module-only = mounts.missing applianceMounts {
        "/" = {
          device = "/dev/disk/by-label/nixos";
          autoResize = true;
          fsType = "ext4";
        };
        "/boot" = {
          device = "/dev/disk/by-label/ESP";
          fsType = "vfat";
        };
      };
      # all of them, with the option NixOS adds to every mount
      merged = mounts.missing applianceMounts (
        builtins.mapAttrs (_: fs: fs // { options = [ "defaults" ] ++ fs.options or [ ]; }) applianceMounts
      );
      other-device = mounts.missing applianceMounts (
        applianceMounts
        // {
          "/var/lib/private/glm53" = applianceMounts."/var/lib/private/glm53" // {
            device = "/dev/sdb1";
          };
        }
      );
    };

    # Where torch's CUDA libraries come from, for the pinned torch and its recorded imports.
    torch-cuda = torchCuda { };
    torch-cuda-problems = {
      # a record made for another torch wheel
      other-torch = (torchCuda {
        record = torchCudaRecord // {
          torch = {
            filename = "torch-2.14.0-cp313-cp313-manylinux_2_28_x86_64.whl";
            sha256 = "0000000000000000000000000000000000000000000000000000000000000000";
          };
        };
      }).problems;
      # NVSHMEM 3.4.5 (in nixpkgs at a revision read) lacks a function torch 2.15 imports
      nvshmem-3_4_5 = (torchCuda {
        record = torchCudaRecord // {
          libraries = torchCudaRecord.libraries // {
            "libnvshmem_host.so.3" = torchCudaRecord.libraries."libnvshmem_host.so.3" // {
              required = "3.4.5";
            };
          };
        };
        pins = realPins // {
          libraries = realPins.libraries // {
            nvidia-nvshmem-cu13 = realPins.libraries.nvidia-nvshmem-cu13 // {
              version = "3.4.5";
            };
          };
        };
      }).problems;
    };
    # Without its wheel pinned, NCCL would come from nixpkgs, and only a nixpkgs NCCL of 2.30.7 would do (nixpkgs
    # carried 2.27.x and 2.28.7 at revisions read; torch.nix then stops the evaluation).
    torch-cuda-nccl-from-nixpkgs =
      (torchCuda {
        pins = realPins // {
          libraries = removeAttrs realPins.libraries [ "nvidia-nccl-cu13" ];
          replaced = realPins.replaced // {
            nvidia-nccl-cu13 = "2.30.7";
          };
        };
      }).nixpkgs.nccl;

    # What each driver branch supports of CUDA 13.2, and the appliance's choice among nixpkgs' driver packages
    # (production first, then latest) as the branches stood at nixpkgs revisions read.
    driver = {
      support = builtins.listToAttrs (
        map (version: {
          name = version;
          value = driver.support version;
        }) [ "550.54.15" "575.64.05" "580.159.04" "590.48.01" "595" "595.45.04" "610.43.03" ]
      );
      choice = map (candidates: (driver.choose candidates).version) [
        [ { version = "580.119.02"; } { version = "590.48.01"; } ]
        [ { version = "580.119.02"; } { version = "595.84"; } ]
        [ { version = "595.84"; } { version = "610.43.03"; } ]
      ];
    };

    cuda-arch-list = {
      default = cuda.torchArchList cuda.defaultCapabilities;
      hopper-specific = cuda.torchArchList [ "9.0a" ];
      rejects-empty = rejects (cuda.torchArchList [ ]);
      rejects-native = rejects (cuda.torchArchList [ "native" ]);
    };
    # The expert-cache library the package build must install (nix/pkgs/glm53.nix checks for it), next to the
    # TORCH_CUDA_ARCH_LIST it is built from; tests/native/test_libraries.py checks that glm53's own build names
    # each one the same.
    cuda-ec-library =
      map
        (capabilities: {
          archList = cuda.torchArchList capabilities;
          library = cuda.ecLibrary capabilities;
        })
        [
          cuda.defaultCapabilities
          [ "9.0a" ]
          [ "10.0f" "12.0" ]
          [ "9.0" "8.9" "9.0" ]
        ];
  };

  # Differences between two JSON values, as lines naming the path where they differ.
  diff =
    path: want: got:
    if want == got then
      [ ]
    else if isAttrs want && isAttrs got then
      concatMap (
        key:
        if !(want ? ${key}) then
          [ "${path}.${key}: not expected, got ${toJSON got.${key}}" ]
        else if !(got ? ${key}) then
          [ "${path}.${key}: missing, expected ${toJSON want.${key}}" ]
        else
          diff "${path}.${key}" want.${key} got.${key}
      ) (attrNames (want // got))
    else if isList want && isList got && length want == length got then
      concatLists (genList (i: diff "${path}[${toString i}]" (elemAt want i) (elemAt got i)) (length want))
    else
      [ "${path}: expected ${toJSON want}, got ${toJSON got}" ];

  check =
    name:
    let
      file = ./golden + "/${name}.json";
      # Through JSON, as the expectation went, so that both sides have the same types.
      got = fromJSON (toJSON cases.${name});
    in
    if pathExists file then
      diff name (fromJSON (readFile file)) got
    else
      [ "${name}: no nix/tests/golden/${name}.json (run nix/ci/check.sh --update-golden)" ];
in
{
  inherit cases;
  names = attrNames cases;
  failures = concatMap check (attrNames cases);
}
