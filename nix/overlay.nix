# overlays.default: this project's packages as pkgs.glm53 (nix/pkgs/default.nix). They use Python 3.13 and the CUDA
# 13.2 package set of the nixpkgs they are applied to; what that nixpkgs' config says about unfree licences and
# cudaCapabilities applies.
final: _prev: {
  glm53 = final.callPackage ./pkgs { };
}
