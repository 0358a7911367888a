# exllamav3's CUDA extension (exllamav3_ext), compiled at build time for the configured cudaCapabilities from the
# sources in the pinned exllamav3 wheel (see exllamav3-ext/setup.py for why and how). One build serves both modes:
# fast and exact differ at run time only.
{
  lib,
  runCommand,
  fetchurl,
  unzip,
  ninja,
  python,
  cudaPackages,
  autoAddDriverRunpath,
  torch,
  # exllamav3's pin from nix/pins/pypi.json
  pin,
}:
let
  inherit (cudaPackages)
    backendStdenv
    cccl
    cuda_cudart
    cuda_nvcc
    libcublas
    libcurand
    libcusolver
    libcusparse
    ;
  cuda = import ../lib/cuda.nix;
  archList = cuda.torchArchList cudaPackages.flags.cudaCapabilities;
  wheel = fetchurl { inherit (pin) url hash; };
in
# nvcc accepts only some host compilers; backendStdenv is the one nixpkgs pairs with this CUDA release.
(python.pkgs.buildPythonPackage.override { stdenv = backendStdenv; }) {
  pname = "exllamav3-ext";
  inherit (pin) version;
  pyproject = true;

  src = runCommand "exllamav3-${pin.version}-ext-src" { nativeBuildInputs = [ unzip ]; } ''
    mkdir "$out"
    unzip -q ${wheel} 'exllamav3/exllamav3_ext/*' exllamav3/util/cuda_flags.py -d "$out"
    cp ${./exllamav3-ext/setup.py} "$out/setup.py"
  '';

  build-system = [ python.pkgs.setuptools ];
  nativeBuildInputs = [
    cuda_nvcc
    ninja
    autoAddDriverRunpath
  ];
  buildInputs = [
    cccl
    cuda_cudart
    libcublas
    libcurand
    libcusolver
    libcusparse
  ];
  dependencies = [ torch ];
  # ninja is here for torch's BuildExtension to run; its setup hook must not take over the build and install phases.
  dontUseNinjaBuild = true;
  dontUseNinjaInstall = true;
  dontUseNinjaCheck = true;

  env = {
    # As nixpkgs' own exllamav3 derivation sets it.
    CUDA_HOME = "${lib.getDev cuda_nvcc}";
    TORCH_CUDA_ARCH_LIST = archList;
    # Fail instead of silently storing uncompressed kernel images when nvcc lacks --compress-mode.
    EXLLAMA_EXT_COMPRESS = "require";
    EXLLAMAV3_VERSION = pin.version;
  };
  # ninja runs one nvcc per kernel file, each compiling it for every capability; exllamav3's README has MAX_JOBS
  # lowered to about 4 where ninja runs out of RAM, so allow one job per 4 GiB of available memory, and at most one
  # per core.
  preBuild = ''
    byRam=$(( $(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo) / (4 * 1024 * 1024) ))
    export MAX_JOBS=$(( byRam < NIX_BUILD_CORES ? byRam : NIX_BUILD_CORES ))
    if (( MAX_JOBS < 1 )); then MAX_JOBS=1; fi
    echo "exllamav3-ext: $MAX_JOBS parallel nvcc jobs ($NIX_BUILD_CORES cores, $byRam x 4 GiB available)"
  '';
  # 177 kernel files x the configured capabilities: hours on a small builder (README, "Build cost")
  requiredSystemFeatures = [ "big-parallel" ];

  # torch first: the extension resolves its libtorch symbols from the libraries torch has loaded, as it does when
  # exllamav3/ext.py imports it.
  pythonImportsCheck = [
    "torch"
    "exllamav3_ext"
  ];

  passthru = {
    inherit cudaPackages;
    torchCudaArchList = archList;
  };

  meta = {
    description = "exllamav3's CUDA kernels, compiled at build time for the configured CUDA capabilities";
    homepage = "https://github.com/turboderp-org/exllamav3";
    license = lib.licenses.mit;
    platforms = [ "x86_64-linux" ];
  };
}
