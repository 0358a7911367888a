# The nixpkgs revision flake.lock pins, and where each value came from. nix/ci/lock.nix fails when flake.nix or
# flake.lock says anything else, so moving the pin means changing this record too.
{
  # A release branch: after the release it takes security fixes and backports only.
  branch = "nixos-26.05";
  rev = "0d9e9b832d03ac387417e16ce1febf73b2e631e1";
  # 2026-10-04
  lastModified = 1791143449;
  # Not recomputed here: no machine this project builds on can download nixpkgs (its source is 4.4 GB and
  # github.com does not resolve). Copied, with lastModified, from the public flake.lock of github:kido5217/Vsrata
  # at commit af95fcc77953e4aadf06ffbe4e1276098e9de0be, whose nixpkgs input is nixos-26.05 locked to this rev
  # (the NAR hash of a tarball is the same whether the input is a flake or not). A wrong value fails closed: Nix
  # refuses the tarball with a NAR hash mismatch on the first networked fetch (nix/ci/release-check.sh).
  narHash = "sha256-9+n3ReS2y9xS199LoJjKUWHwZrISGHWgkD/LUZTDZyA=";
}
