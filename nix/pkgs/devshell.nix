# devShells.default: Python 3.13 with every pinned runtime and development package, the glm53 source taken from
# the checkout (PYTHONPATH), nvcc of the CUDA release torch was built with for kernel work, and the tools the
# tests and nix/ci use.
{
  lib,
  mkShell,
  curl,
  git,
  jq,
  ruff,
  python,
  cudaPackages,
  pythonPackages,
}:
let
  cuda = import ../lib/cuda.nix;
in
mkShell {
  packages = [
    (python.withPackages (_: pythonPackages.runtimeRoots ++ pythonPackages.devRoots))
    cudaPackages.cuda_nvcc
    curl
    git
    jq
    ruff
  ];
  env = {
    CUDA_HOME = "${lib.getDev cudaPackages.cuda_nvcc}";
    TORCH_CUDA_ARCH_LIST = cuda.torchArchList cudaPackages.flags.cudaCapabilities;
  };
  shellHook = ''
    export PYTHONPATH="$PWD''${PYTHONPATH:+:$PYTHONPATH}"
  '';
}
