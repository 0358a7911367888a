# torch from its PyPI wheel (built by PyTorch for CUDA 13.2), patched the way nixpkgs' torch-bin patches the
# pytorch.org wheels: every ELF file is pointed at the CUDA libraries of the Nix store (the wheel's own RPATH names
# pip's nvidia-* wheels, which are not installed), and libcuda.so.1 is left to the host driver.
#
# Which CUDA libraries, and from where, is decided from nix/pins/torch-cuda.json by nix/lib/torch-cuda.nix: those
# torch's metadata pins to exact builds of their own (NCCL, NVSHMEM, cuDNN, cuSPARSELt) from their pinned wheels
# (cuda-wheel-libs.nix), the CUDA 13.2 toolkit libraries from cudaPackages_13_2, at a build the record shows to export
# every symbol torch imports. What cudaPackages_13_2 holds at the pinned nixpkgs could not be read offline; the
# assertions below check it, at evaluation, before anything is built. libcurand and cuda_nvtx, which nixpkgs'
# torch-bin adds, are not among them: this wheel neither NEEDs nor dlopen()s them (the record lists what it NEEDs).
{
  lib,
  stdenv,
  zlib,
  python,
  cudaPackages,
  autoPatchelfHook,
  autoAddDriverRunpath,
  # the generic wheel builder of python-set.nix, applied to torch's pin
  wheel,
  # nix/lib/pins.nix's result
  pins,
  # cuda-wheel-libs.nix's result: pinned CUDA wheel -> its libraries
  cudaWheelLibs,
}:
let
  inherit (cudaPackages) cudaMajorMinorVersion;

  cuda = import ../lib/torch-cuda.nix { inherit pins; };
  fromNixpkgs = lib.mapAttrsToList (attr: want: want // { package = cudaPackages.${attr}; }) cuda.nixpkgs;
  fromWheels = map (name: cudaWheelLibs.${name}) (lib.attrNames cuda.wheels);
  unsatisfied = lib.filter (l: !(lib.elem l.package.version l.versions)) fromNixpkgs;
  describe =
    l:
    "${l.package.pname} ${l.package.version} (${lib.concatStringsSep ", " l.sonames}; checked to satisfy torch: ${lib.concatStringsSep ", " l.versions})";
in
assert lib.assertMsg (cudaMajorMinorVersion == "13.2")
  "torch 2.15.0's wheel is built for CUDA 13.2; the package set given is CUDA ${cudaMajorMinorVersion}";
assert lib.assertMsg (cuda.problems == [ ]) (lib.concatStringsSep "\n" cuda.problems);
assert lib.assertMsg (unsatisfied == [ ]) ''
  cudaPackages_13_2 holds builds that nix/pins/torch-cuda.json does not show to export every symbol torch imports:
    ${lib.concatMapStringsSep "\n  " describe unsatisfied}
  Add this CUDA release to CUDA_RELEASES in nix/pins/torch_cuda.py and rerun it; if a build lacks symbols, link
  torch against that library's pinned wheel instead (LINKED in nix/pins/update.py).'';
wheel {
  nativeBuildInputs = [
    autoPatchelfHook
    autoAddDriverRunpath
  ];
  # libgomp and libgfortran come inside the wheel; libgfortran needs gcc's libquadmath.
  buildInputs = [
    stdenv.cc.cc.lib
    zlib
  ]
  ++ map (l: l.package) fromNixpkgs
  ++ fromWheels;

  # The driver's userspace library: it must come from the machine the program runs on (/run/opengl-driver/lib
  # on NixOS, a mount by the NVIDIA container toolkit in a container), never from the store.
  autoPatchelfIgnoreMissingDeps = [ "libcuda.so.1" ];

  postFixup = ''
    addAutoPatchelfSearchPath "$out/${python.sitePackages}/torch/lib"
  '';

  # torch also dlopen()s libnvrtc by name from libraries that do not NEED it, which only a runpath entry lets the
  # loader find (nixpkgs issue 296179); added after autoPatchelf has run, as nixpkgs' torch-bin does.
  nvrtcLib = "${lib.getLib cudaPackages.cuda_nvrtc}/lib";
  postPhases = [ "addNvrtcRunpathPhase" ];
  addNvrtcRunpathPhase = ''
    find "$out" -type f -name '*.so' -print0 | while IFS= read -r -d "" elf; do
      patchelf --add-rpath "$nvrtcLib" "$elf"
    done
  '';

  # Stripping the wheel's libraries breaks them ("ELF load command address/offset not properly aligned").
  dontStrip = true;

  pythonImportsCheck = [ "torch" ];

  passthru = {
    inherit cudaPackages;
    # where each CUDA library torch NEEDs comes from (nix/ci/release-check.sh prints it, nix/ci/wheel_deps.py
    # checks torch's ELF files against it)
    cudaLibraries = {
      nixpkgs = lib.mapAttrs (attr: want: {
        inherit (cudaPackages.${attr}) version;
        inherit (want) sonames;
      }) cuda.nixpkgs;
      wheels = lib.mapAttrs (_: w: { inherit (w) version sonames; }) cuda.wheels;
    };
    cudaSupport = true;
    cudaCapabilities = cudaPackages.flags.cudaCapabilities;
  };

  meta = {
    description = "PyTorch from PyPI's CUDA 13.2 wheel, linked against nixpkgs' cudaPackages_13_2 and the CUDA wheels it pins";
    homepage = "https://pytorch.org/";
    # BSD-3 for torch itself; the wheel links NVIDIA's CUDA libraries and bundles Intel's oneDNN/MKL pieces.
    license = with lib.licenses; [
      bsd3
      issl
      unfreeRedistributable
    ];
    sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
    platforms = [ "x86_64-linux" ];
  };
}
