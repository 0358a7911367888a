# torch from its PyPI wheel (built by PyTorch for CUDA 13.2), patched the way nixpkgs' torch-bin patches the
# pytorch.org wheels: every ELF file is pointed at the CUDA libraries of cudaPackages_13_2 (the wheel's own RPATH
# names pip's nvidia-* wheels, which are not installed), and libcuda.so.1 is left to the host driver.
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
  # CUDA wheels pip resolved next to torch, with versions (nix/pins/pypi.json "replaced")
  replaced,
}:
let
  inherit (cudaPackages) cudaMajorMinorVersion;

  # Each CUDA library torch's ELF files NEED (read from the wheel with readelf), the package of cudaPackages
  # that provides it, and the pip wheel torch was built against. NVIDIA breaks ABI only across major versions, so
  # the majors must agree. What cudaPackages_13_2 holds at the pinned nixpkgs could not be read offline; this
  # assertion is what checks it, at evaluation, before anything is built.
  libraries = with cudaPackages; [
    { package = cuda_cudart; wheel = "nvidia-cuda-runtime"; } # libcudart.so.13
    { package = cuda_cupti; wheel = "nvidia-cuda-cupti"; } # libcupti.so.13
    { package = cuda_nvrtc; wheel = "nvidia-cuda-nvrtc"; } # libnvrtc.so.13
    { package = cudnn; wheel = "nvidia-cudnn-cu13"; } # libcudnn.so.9
    { package = libcublas; wheel = "nvidia-cublas"; } # libcublas.so.13, libcublasLt.so.13
    { package = libcufft; wheel = "nvidia-cufft"; } # libcufft.so.12
    { package = libcufile; wheel = "nvidia-cufile"; } # libcufile.so.0
    { package = libcusolver; wheel = "nvidia-cusolver"; } # libcusolver.so.12
    { package = libcusparse; wheel = "nvidia-cusparse"; } # libcusparse.so.12
    { package = libcusparse_lt; wheel = "nvidia-cusparselt-cu13"; } # libcusparseLt.so.0
    { package = nccl; wheel = "nvidia-nccl-cu13"; } # libnccl.so.2
    { package = libnvshmem; wheel = "nvidia-nvshmem-cu13"; } # libnvshmem_host.so.3
  ];
  mismatches = lib.filter (
    l: lib.versions.major l.package.version != lib.versions.major replaced.${l.wheel}
  ) libraries;
  describe = l: "${l.package.pname} ${l.package.version} (torch was built with ${l.wheel} ${replaced.${l.wheel}})";
in
assert lib.assertMsg (cudaMajorMinorVersion == "13.2")
  "torch 2.15.0's wheel is built for CUDA 13.2; the package set given is CUDA ${cudaMajorMinorVersion}";
assert lib.assertMsg (mismatches == [ ])
  "CUDA libraries whose major version differs from torch's build: ${lib.concatMapStringsSep ", " describe mismatches}";
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
  ++ map (l: l.package) libraries;

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
    cudaSupport = true;
    cudaCapabilities = cudaPackages.flags.cudaCapabilities;
  };

  meta = {
    description = "PyTorch from PyPI's CUDA 13.2 wheel, linked against nixpkgs' cudaPackages_13_2";
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
