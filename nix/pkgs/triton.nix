# triton from its PyPI wheel. The wheel carries its own ptxas, cuobjdump, nvdisasm and CUPTI; autoPatchelfHook
# gives them the store's loader and libraries (they need only glibc, libstdc++ and zlib, read with readelf).
#
# At run time Triton compiles a small C launcher per kernel signature (CC, set by the serve wrapper) and links it
# against the driver's libcuda.so.1, whose directory it looks up with /sbin/ldconfig. Neither NixOS nor the OCI
# image has that, so the lookup is patched to look where Nix programs find the driver (/run/opengl-driver/lib)
# and in LD_LIBRARY_PATH, where the container toolkit's mount is named. TRITON_LIBCUDA_PATH still overrides both.
{
  lib,
  stdenv,
  zlib,
  python,
  autoPatchelfHook,
  addDriverRunpath,
  # the generic wheel builder of python-set.nix, applied to triton's pin
  wheel,
}:
let
  driverLib = "${addDriverRunpath.driverLink}/lib";
  # triton 3.9.0's backends/nvidia/driver.py: --replace-fail stops the build if the text moved, and
  # nix/ci/wheel_deps.py checks it in the pinned wheel.
  libcudaLookup = {
    file = "triton/backends/nvidia/driver.py";
    text = ''libs = subprocess.check_output(["/sbin/ldconfig", "-p"]).decode(errors="ignore")'';
  };
in
wheel {
  nativeBuildInputs = [ autoPatchelfHook ];
  buildInputs = [
    stdenv.cc.cc.lib
    zlib
  ];

  postInstall = ''
    substituteInPlace "$out/${python.sitePackages}/${libcudaLookup.file}" \
      --replace-fail ${lib.escapeShellArg libcudaLookup.text} \
        'libs = "libcuda.so.1 => ${driverLib}/libcuda.so.1" if os.path.exists("${driverLib}/libcuda.so.1") else ""'
  '';

  # libMLIRDialectPlugin.so finds libtriton.so through an RPATH of the wheel's build tree.
  preFixup = ''
    addAutoPatchelfSearchPath "$out/${python.sitePackages}/triton/_C"
  '';

  pythonImportsCheck = [ "triton" ];

  passthru = { inherit libcudaLookup; };

  meta = {
    description = "Triton from its PyPI wheel, with its driver lookup patched for Nix";
    homepage = "https://github.com/triton-lang/triton";
    license = lib.licenses.mit;
    sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
    platforms = [ "x86_64-linux" ];
  };
}
