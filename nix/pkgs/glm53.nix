# The glm53 Python package, built from this repository, with the dependencies pyproject.toml names for the served
# program (dependencies + the serve, gpu and hub extras) taken from the pinned wheels, and the project's kernels
# compiled by setup.py into glm53/_native/ (g++ for the CPU tier, nvcc for the configured GPUs).
{
  lib,
  python,
  cudaPackages,
  autoAddDriverRunpath,
  torch,
  # python-set.nix's packages for the runtime roots of nix/pins/pypi.json
  dependencies,
}:
let
  root = ../..;
  manifest = lib.importTOML (root + "/pyproject.toml");
  cuda = import ../lib/cuda.nix;
  inherit (cudaPackages.flags) cudaCapabilities;

  # Only what the package is built from, so edits to Nix files, tests or docs other than README.md do not rebuild it.
  src = lib.fileset.toSource {
    inherit root;
    fileset = lib.fileset.unions [
      (root + "/pyproject.toml")
      # builds the native libraries into the package (glm53/_native/)
      (root + "/setup.py")
      # pyproject.toml's `readme`: setuptools reads it into the package metadata
      (root + "/README.md")
      (root + "/glm53")
      # the kernels' sources and Makefile, without a checkout's own build outputs
      (lib.fileset.difference (root + "/native") (lib.fileset.maybeMissing (root + "/native/build")))
    ];
  };

  # What setup.py puts in glm53/_native/: the CPU tier's kernels and the expert cache's CUDA kernels, one library with
  # machine code for every configured GPU.
  nativeLibraries = [
    "libglm53_cpu_expert.so"
    (cuda.ecLibrary cudaCapabilities)
  ];

  # the built-in page (glm53/server/web/): every file the source has, as the package must carry it
  webPage = [ "index.html" ] ++ map (name: "assets/${name}") (builtins.attrNames (builtins.readDir (root + "/glm53/server/web/assets")));
in
# nvcc accepts only some host compilers; backendStdenv is the one nixpkgs pairs with this CUDA release. Its C++
# compiler also builds the CPU kernels (native/Makefile).
(python.pkgs.buildPythonPackage.override { stdenv = cudaPackages.backendStdenv; }) {
  pname = "glm53";
  inherit (manifest.project) version;
  pyproject = true;
  inherit src;

  build-system = [ python.pkgs.setuptools ];
  inherit dependencies;

  nativeBuildInputs = [
    cudaPackages.cuda_nvcc
    # so that a libcuda dlopen finds the host's driver (/run/opengl-driver/lib)
    autoAddDriverRunpath
  ];
  buildInputs = [
    cudaPackages.cccl
    cudaPackages.cuda_cudart
  ];
  env = {
    CUDA_HOME = "${lib.getDev cudaPackages.cuda_nvcc}";
    # setup.py builds the expert cache's library for exactly these GPUs, and fails when it finds no nvcc.
    TORCH_CUDA_ARCH_LIST = cuda.torchArchList cudaCapabilities;
    # The compiler wrapper removes -march=native: it would tie the binary to the build machine's CPU. The CPU
    # kernels name their instruction set themselves (-mavx2 -mfma -mf16c) and dispatch to wider units at run time.
    NIX_ENFORCE_NO_NATIVE = "1";
  };
  # nixpkgs' default hardening flags cost the CPU kernels 3-9 % of their AVX-512 VBMI rate, these two most:
  # -fno-strict-overflow rewrites the kernels' loops and -fzero-call-used-regs every kernel function's return. With
  # the others (fortify3, stack protector, stack clash protection) the rate is within 2 % of a build with none
  # (bench/results/2026-12-02-cpu-kernel-hardening.md).
  hardeningDisable = [
    "strictoverflow"
    "zerocallusedregs"
  ];
  preBuild = ''
    export MAX_JOBS="$NIX_BUILD_CORES"
  '';

  # A package without its kernels would fail only on the GPU machine: refuse to build one. The built-in page's files
  # are package data (pyproject.toml): without them `/` would answer 500, so their absence fails the build too.
  postInstall = ''
    for library in ${lib.escapeShellArgs nativeLibraries}; do
      if [ ! -f "$out/${python.sitePackages}/glm53/_native/$library" ]; then
        echo "glm53/_native/$library is missing from the package; setup.py builds it (see nix/pkgs/glm53.nix)" >&2
        exit 1
      fi
    done
    for page in ${lib.escapeShellArgs webPage}; do
      if [ ! -f "$out/${python.sitePackages}/glm53/server/web/$page" ]; then
        echo "glm53/server/web/$page is missing from the package; pyproject.toml's package-data ships it" >&2
        exit 1
      fi
    done
  '';

  # Neither imports torch or touches a GPU: they check that the server's own imports (flask, gunicorn, gevent,
  # pydantic, jinja2) resolve in the closure.
  pythonImportsCheck = [
    "glm53.cli"
    "glm53.server.gunicorn_app"
  ];
  # The CPU kernels load from the installed package and report the instruction sets of the build machine (the CUDA
  # library needs a GPU driver to load).
  postInstallCheck = ''
    PYTHONPATH="$out/${python.sitePackages}:$PYTHONPATH" ${python.interpreter} -c \
      'from glm53.cpu_tier import kernel as cpu_expert; print(cpu_expert.locate(), cpu_expert.available_isas())'
  '';

  passthru = { inherit torch nativeLibraries; };

  meta = {
    inherit (manifest.project) description;
    license = lib.licenses.asl20;
    mainProgram = "glm53";
    platforms = [ "x86_64-linux" ];
  };
}
