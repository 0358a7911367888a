# The one nixpkgs instance the flake builds with: nixpkgs' configuration for CUDA and this project's overlay.
{
  nixpkgs,
  system,
  cudaCapabilities ? (import ./lib/cuda.nix).defaultCapabilities,
}:
import nixpkgs {
  inherit system;
  config = {
    # The closure holds NVIDIA's CUDA libraries, cuDNN and NCCL, and the appliance the NVIDIA driver: unfree but
    # redistributable. This instance builds only this flake's outputs.
    allowUnfree = true;
    # No cudaSupport: the project's packages take cudaPackages_13_2 by name (nix/pkgs/default.nix), and the switch
    # would rebuild any nixpkgs package of the closures that has a CUDA variant against nixpkgs' default, CUDA 12.
    inherit cudaCapabilities;
    # Machine code for each listed GPU and no PTX for newer ones (nix/lib/cuda.nix says why).
    cudaForwardCompat = false;
  };
  overlays = [ (import ./overlay.nix) ];
}
