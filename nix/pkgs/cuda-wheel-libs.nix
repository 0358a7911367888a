# The CUDA libraries torch is linked against from their PyPI wheels (nix/pins/pypi.json "libraries"): the exact builds
# torch's metadata pins, where nixpkgs builds other versions (nix/pins/update.py LINKED; nix/pins/torch-cuda.json
# shows what the versions nixpkgs carried lack). Each wheel's nvidia/<name>/lib becomes $out/lib, the layout of
# nixpkgs' CUDA packages, so that autoPatchelf finds the libraries when they are a build input of torch. Taking them
# from the wheels also spares the builder nixpkgs' source builds of NCCL and of NVSHMEM with MPI and UCX.
{
  lib,
  stdenv,
  fetchurl,
  unzip,
  zlib,
  autoPatchelfHook,
  autoAddDriverRunpath,
  cudaPackages,
  # nix/lib/pins.nix's `libraries`
  pins,
}:
let
  # What to install from each wheel's lib directory, and the directories of what its libraries dlopen() by name
  # besides their NEEDED entries (in the wheel: RUNPATH $ORIGIN, and for cuDNN pip's cuBLAS and NVRTC wheels);
  # autoPatchelf rewrites RUNPATH to the NEEDED libraries' directories only, so these are added back after it.
  layouts = {
    nvidia-cudnn-cu13 = {
      dir = "cudnn";
      # libcudnn.so.9 loads its engine and graph libraries on demand
      files = [ "libcudnn*.so.9" ];
      dlopens = [
        "${placeholder "out"}/lib"
        "${lib.getLib cudaPackages.libcublas}/lib"
        "${lib.getLib cudaPackages.cuda_nvrtc}/lib"
      ];
    };
    nvidia-cusparselt-cu13 = {
      dir = "cusparselt";
      files = [ "libcusparseLt.so.0" ];
      dlopens = [ "${lib.getLib cudaPackages.cuda_nvrtc}/lib" ];
    };
    nvidia-nccl-cu13 = {
      dir = "nccl";
      files = [ "libnccl.so.2" ];
      dlopens = [ ];
    };
    # Only the host library and the bootstrap and transport plugins that need nothing outside glibc and libstdc++:
    # the others NEED MPI, PMIx, OpenSHMEM, UCX, libfabric or Mellanox's libmlx5, which this closure does not hold.
    # torch loads libnvshmem_host only because libtorch_cuda NEEDs it; this single-GPU server never initialises
    # NVSHMEM.
    nvidia-nvshmem-cu13 = {
      dir = "nvshmem";
      files = [
        "libnvshmem_host.so.3"
        "nvshmem_bootstrap_pmi.so.3"
        "nvshmem_bootstrap_pmi2.so.3"
        "nvshmem_bootstrap_uid.so.3"
        "nvshmem_transport_ibrc.so.6"
      ];
      # libnvshmem_host loads its plugins from its own directory
      dlopens = [ "${placeholder "out"}/lib" ];
    };
  };

  build =
    name: pin:
    let
      layout =
        layouts.${name}
          or (throw "nix/pkgs/cuda-wheel-libs.nix: no layout for the pinned CUDA wheel ${name}; add one");
    in
    stdenv.mkDerivation {
      pname = name;
      inherit (pin) version;
      src = fetchurl { inherit (pin) url hash; };

      nativeBuildInputs = [
        unzip
        autoPatchelfHook
        # all four dlopen() libcuda.so.1, NCCL and NVSHMEM libnvidia-ml.so.1 too: /run/opengl-driver/lib on NixOS
        autoAddDriverRunpath
      ];
      buildInputs = [
        stdenv.cc.cc.lib
        zlib
      ];

      dontUnpack = true;
      installPhase = ''
        runHook preInstall
        unzip -q "$src" -d wheel
        mkdir -p "$out/lib" "$out/share/licenses/${name}"
        cp -t "$out/lib" ${lib.concatMapStringsSep " " (f: "wheel/nvidia/${layout.dir}/lib/${f}") layout.files}
        find wheel -iname 'license*' -type f -exec cp -t "$out/share/licenses/${name}" {} +
        runHook postInstall
      '';

      dlopenRunpath = lib.concatStringsSep ":" layout.dlopens;
      postPhases = lib.optionals (layout.dlopens != [ ]) [ "addDlopenRunpathPhase" ];
      addDlopenRunpathPhase = ''
        for elf in "$out"/lib/*.so*; do
          patchelf --add-rpath "$dlopenRunpath" "$elf"
        done
      '';

      # NVIDIA's binaries, as nixpkgs' own CUDA redistributables are installed: not stripped.
      dontStrip = true;

      # what is installed, for nix/ci/wheel_deps.py
      passthru.layout = { inherit (layout) dir files; };

      meta = {
        description = "${name}'s shared libraries from its PyPI wheel, for torch";
        homepage = "https://pypi.org/project/${name}/${pin.version}/";
        license = lib.licenses.unfreeRedistributable;
        sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
        platforms = [ "x86_64-linux" ];
      };
    };
in
lib.mapAttrs build pins
