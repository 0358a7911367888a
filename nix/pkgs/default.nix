# pkgs.glm53: everything this project builds, against Python 3.13 and the CUDA 13.2 package set, both chosen here
# by name rather than through nixpkgs' moving defaults (cudaPackages is still CUDA 12 in nixos-26.05, and
# cudaPackages_13 follows the newest 13.x).
{
  callPackage,
  python313,
  cudaPackages_13_2,
}:
let
  python = python313;
  cudaPackages = cudaPackages_13_2;
  pythonPackages = callPackage ./python-set.nix { inherit python cudaPackages; };

  glm53 = callPackage ./glm53.nix {
    inherit python cudaPackages;
    inherit (pythonPackages) torch;
    # redis: the client of a fleet's shared Responses store (GLM53_RESPONSES_STORE_URL), pure Python, from nixpkgs
    dependencies = pythonPackages.runtimeRoots ++ [ python.pkgs.redis ];
  };
  serve = mode: callPackage ./serve.nix { inherit python glm53 mode; };
  serve-fast = serve "fast";
  serve-exact = serve "exact";
in
{
  inherit
    python
    cudaPackages
    pythonPackages
    glm53
    serve-fast
    serve-exact
    ;
  inherit (pythonPackages) exllamav3 torch triton;
  sglang-router = callPackage ./sglang-router.nix { inherit python; };
  oci-fast = callPackage ./oci.nix { serve = serve-fast; };
  oci-exact = callPackage ./oci.nix { serve = serve-exact; };
  devShell = callPackage ./devshell.nix { inherit python cudaPackages pythonPackages; };
}
