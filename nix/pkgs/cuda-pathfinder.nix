# cuda-pathfinder from its wheel, with its library search starting in the Nix store.
#
# cuda-bindings (torch depends on it) binds the CUDA libraries at run time: its compiled modules ask
# cuda.pathfinder.load_nvidia_dynamic_lib("nvrtc") and the like, which looks in pip's nvidia-* wheels, in conda and
# through the system's loader, none of which holds nixpkgs' libraries, and then fails. nixpkgs' cuda-bindings patches
# each of those loads to a store path in its Cython sources; the wheel's modules are compiled, so the search itself is
# patched here: it looks first in `root`, a directory laid out as a CUDA toolkit (pathfinder's descriptors say where
# it looks under one: lib/, and nvvm/lib64/ for libnvvm) holding the libraries of the nixpkgs packages below. The
# driver's libraries (libcuda.so.1, libnvidia-ml.so.1) pathfinder finds only through the system's loader: the serve
# wrapper puts them on LD_LIBRARY_PATH (host-driver.sh). nix/ci/wheel_deps.py checks all this against the pinned
# wheels of cuda-bindings and cuda-pathfinder.
{
  lib,
  runCommand,
  python,
  cudaPackages,
  # the generic wheel builder of python-set.nix, applied to cuda-pathfinder's pin
  wheel,
}:
let
  # pathfinder's name of each library cuda-bindings binds -> the nixpkgs package that holds it, its files (with those
  # it loads beside itself, such as libnvrtc-builtins), and where under the root pathfinder looks for them
  libraries = {
    cudart = {
      package = "cuda_cudart";
      dir = "lib";
      files = "libcudart*.so*";
    };
    nvrtc = {
      package = "cuda_nvrtc";
      dir = "lib";
      files = "libnvrtc*.so*";
    };
    nvJitLink = {
      package = "libnvjitlink";
      dir = "lib";
      files = "libnvJitLink*.so*";
    };
    nvvm = {
      package = "libnvvm";
      dir = "nvvm/lib64";
      files = "libnvvm*.so*";
    };
    cufile = {
      package = "libcufile";
      dir = "lib";
      files = "libcufile*.so*";
    };
    nvfatbin = {
      package = "libnvfatbin";
      dir = "lib";
      files = "libnvfatbin*.so*";
    };
  };
  # bound by cuda-bindings but not taken from the store, and why
  elsewhere = {
    cuda = "the driver's: from the host, through LD_LIBRARY_PATH";
    nvml = "the driver's: from the host, through LD_LIBRARY_PATH";
    cudla = "NVIDIA's deep-learning accelerator library, for Jetson boards only";
  };

  root = runCommand "cuda-bindings-libraries-${cudaPackages.cudaMajorMinorVersion}" { } (
    lib.concatStrings (
      lib.mapAttrsToList (_: l: ''
        mkdir -p "$out/${l.dir}"
        for dir in ${lib.getLib cudaPackages.${l.package}}/lib ${lib.getLib cudaPackages.${l.package}}/lib64; do
          if [ -d "$dir" ]; then
            find "$dir" -maxdepth 1 -name ${lib.escapeShellArg l.files} -exec ln -s -t "$out/${l.dir}" {} +
          fi
        done
      '') libraries
    )
  );

  # The text of cuda-pathfinder 1.9.1's cuda/pathfinder/_dynamic_libs/search_steps.py that is replaced, and the
  # module's own helper that the replacement calls: --replace-fail stops the build if the text moved, and
  # nix/ci/wheel_deps.py checks both in the pinned wheel.
  search = {
    file = "cuda/pathfinder/_dynamic_libs/search_steps.py";
    text = "EARLY_FIND_STEPS: tuple[FindStep, ...] = (find_in_site_packages, find_in_conda)";
    uses = "def _find_under_anchor_root(";
  };
  replacement = ''EARLY_FIND_STEPS: tuple[FindStep, ...] = (lambda ctx: _find_under_anchor_root(ctx, "${root}", "nix-store"), find_in_site_packages, find_in_conda)'';
in
wheel {
  postInstall = ''
    substituteInPlace "$out/${python.sitePackages}/${search.file}" \
      --replace-fail ${lib.escapeShellArg search.text} ${lib.escapeShellArg replacement}
  '';
  passthru = {
    inherit
      root
      search
      libraries
      elsewhere
      ;
  };
}
