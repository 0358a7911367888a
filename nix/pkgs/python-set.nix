# Every Python package of the server and the development shell, from the wheels pinned in nix/pins/pypi.json: the
# same files, with the same hashes, that `pip install glm53[serve,gpu,hub]` picks for CPython 3.13 on Linux. A
# wheel that holds machine code is patched to load its libraries from the Nix store (autoPatchelfHook); torch,
# triton, cuda-pathfinder and exllamav3 get their own recipes on top of that (torch.nix, triton.nix,
# cuda-pathfinder.nix, exllamav3*.nix).
{
  lib,
  stdenv,
  callPackage,
  fetchurl,
  autoPatchelfHook,
  zlib,
  python,
  cudaPackages,
}:
let
  pins = import ../lib/pins.nix { };
  cudaWheelLibs = callPackage ./cuda-wheel-libs.nix {
    inherit cudaPackages;
    pins = pins.libraries;
  };

  # A manylinux_2_N wheel needs glibc 2.N or later; update.py accepts wheels up to pins.manylinuxMax.
  glibc = stdenv.cc.libc.version;
  glibcOk =
    lib.versionAtLeast glibc pins.manylinuxMax
    || throw "glibc ${glibc} is older than manylinux_${pins.manylinuxMax}, the newest wheel level nix/pins/pypi.json accepts";

  fromWheel =
    self: name: pin: overrides:
    assert glibcOk;
    python.pkgs.buildPythonPackage (
      {
        pname = name;
        inherit (pin) version;
        format = "wheel";
        src = fetchurl { inherit (pin) url hash; };
        dependencies = map (dep: self.${dep}) pin.deps;
        # Every native wheel on the pin list needs only glibc, libstdc++/libgcc_s and zlib besides the libraries
        # it bundles (checked with readelf on each wheel when the pins were made).
        nativeBuildInputs = lib.optionals pin.native [ autoPatchelfHook ];
        buildInputs = lib.optionals pin.native [
          stdenv.cc.cc.lib
          zlib
        ];
        # The wheel's metadata still names a dependency the Nix build provides another way (pins "dropped":
        # the CUDA libraries, ninja), which the runtime-dependency check would report as missing.
        dontCheckRuntimeDeps = pin.dropped != [ ];
        meta = {
          homepage = "https://pypi.org/project/${name}/${pin.version}/";
          platforms = [ "x86_64-linux" ];
        }
        // lib.optionalAttrs pin.native { sourceProvenance = [ lib.sourceTypes.binaryNativeCode ]; };
      }
      // overrides
    );

  packages = lib.fix (
    self:
    lib.mapAttrs (name: pin: fromWheel self name pin { }) pins.packages
    // {
      torch = callPackage ./torch.nix {
        inherit python cudaPackages;
        wheel = fromWheel self "torch" pins.packages.torch;
        inherit pins cudaWheelLibs;
      };
      cuda-pathfinder = callPackage ./cuda-pathfinder.nix {
        inherit python cudaPackages;
        wheel = fromWheel self "cuda-pathfinder" pins.packages.cuda-pathfinder;
      };
      triton = callPackage ./triton.nix {
        inherit python;
        wheel = fromWheel self "triton" pins.packages.triton;
      };
      exllamav3-ext = callPackage ./exllamav3-ext.nix {
        inherit python cudaPackages;
        inherit (self) torch;
        pin = pins.packages.exllamav3;
      };
      exllamav3 = fromWheel self "exllamav3" pins.packages.exllamav3 {
        dependencies = map (dep: self.${dep}) pins.packages.exllamav3.deps ++ [ self.exllamav3-ext ];
        # Importing exllamav3 finds exllamav3_ext installed and never reaches its JIT build.
        pythonImportsCheck = [ "exllamav3" ];
        passthru.ext = self.exllamav3-ext;
      };
    }
  );
in
packages
// {
  inherit pins cudaWheelLibs;
  # The packages below each group's roots in pyproject.toml (runtime: dependencies + serve, gpu, hub; dev: dev).
  runtimeRoots = map (name: packages.${name}) pins.roots.runtime;
  devRoots = map (name: packages.${name}) pins.roots.dev;
}
