# The glm53 Python package, built from this repository, with the dependencies pyproject.toml names for the served
# program (dependencies + the serve, gpu and hub extras) taken from the pinned wheels.
{
  lib,
  python,
  cudaPackages,
  ninja,
  torch,
  # python-set.nix's packages for the runtime roots of nix/pins/pypi.json
  dependencies,
}:
let
  root = ../..;
  manifest = lib.importTOML (root + "/pyproject.toml");
  cuda = import ../lib/cuda.nix;

  # Only what the package is built from, so edits to Nix files, tests or docs other than README.md do not rebuild it.
  src = lib.fileset.toSource {
    inherit root;
    fileset = lib.fileset.unions [
      (root + "/pyproject.toml")
      # pyproject.toml's `readme`: setuptools reads it into the package metadata
      (root + "/README.md")
      (root + "/glm53")
      (lib.fileset.maybeMissing (root + "/native"))
    ];
  };

  # C++/CUDA sources of the project's kernels, once native/ holds them.
  nativeSources =
    lib.optionals (builtins.pathExists (root + "/native")) (
      lib.fileset.toList (
        lib.fileset.fileFilter (
          f:
          lib.any f.hasExt [
            "c"
            "cc"
            "cpp"
            "cu"
          ]
        ) (root + "/native")
      )
    );
  hasNative = nativeSources != [ ];
in
(python.pkgs.buildPythonPackage.override { stdenv = cudaPackages.backendStdenv; }) {
  pname = "glm53";
  inherit (manifest.project) version;
  pyproject = true;
  inherit src;

  build-system = [ python.pkgs.setuptools ];
  inherit dependencies;

  nativeBuildInputs = lib.optionals hasNative [
    cudaPackages.cuda_nvcc
    ninja
  ];
  buildInputs = lib.optionals hasNative [
    cudaPackages.cuda_cccl
    cudaPackages.cuda_cudart
  ];
  env = lib.optionalAttrs hasNative {
    CUDA_HOME = "${lib.getDev cudaPackages.cuda_nvcc}";
    TORCH_CUDA_ARCH_LIST = cuda.torchArchList cudaPackages.flags.cudaCapabilities;
    # The compiler wrapper removes -march=native: it would tie the binary to the build machine's CPU. The CPU
    # kernels name their instruction set themselves (-mavx2 -mfma -mf16c) and dispatch to wider units at run time.
    NIX_ENFORCE_NO_NATIVE = "1";
  };
  # ninja is here for torch's BuildExtension to run; its setup hook must not take over the build and install phases.
  dontUseNinjaBuild = true;
  dontUseNinjaInstall = true;
  dontUseNinjaCheck = true;
  preBuild = lib.optionalString hasNative ''
    export MAX_JOBS="$NIX_BUILD_CORES"
  '';

  # A package that ships without its kernels would fail only on the GPU machine: refuse to build one.
  postInstall = lib.optionalString hasNative ''
    if [ -z "$(find "$out/${python.sitePackages}" -name '*.so' -print -quit)" ]; then
      echo "native/ holds C++/CUDA sources, but the package build installed no extension module;" >&2
      echo "pyproject.toml (or setup.py) must build them (see nix/pkgs/glm53.nix)" >&2
      exit 1
    fi
  '';

  # Neither imports torch or touches a GPU: they check that the server's own imports (flask, gunicorn, gevent,
  # pydantic, jinja2) resolve in the closure.
  pythonImportsCheck = [
    "glm53.cli"
    "glm53.server.gunicorn_app"
  ];

  passthru = { inherit torch hasNative; };

  meta = {
    inherit (manifest.project) description;
    license = lib.licenses.asl20;
    mainProgram = "glm53";
    platforms = [ "x86_64-linux" ];
  };
}
