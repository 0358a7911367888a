# The NVIDIA driver branches CUDA 13.2 needs, for the NixOS module's warning and the appliance's choice (builtins
# only; golden-tested). glm53/preflight.py checks the running driver against the same two numbers, and
# tests/test_preflight.py checks that they agree.
let
  inherit (builtins) compareVersions filter head;
in
rec {
  # CUDA 13.0's branch, the oldest that runs CUDA 13 programs: through minor-version compatibility, which loads
  # machine code from any CUDA 13 toolkit but cannot compile CUDA 13.2's PTX and refuses calls added after 13.0.
  minimum = "580";
  # CUDA 13.2's own branch: full support.
  full = "595";

  # "full", "compatibility" or "unsupported", for a driver version such as "580.159.04"
  support =
    version:
    if compareVersions version full >= 0 then
      "full"
    else if compareVersions version minimum >= 0 then
      "compatibility"
    else
      "unsupported";

  # The first driver package of CANDIDATES (in order of preference) that supports CUDA 13.2 fully, else the first.
  choose =
    candidates:
    let
      fully = filter (p: support p.version == "full") candidates;
    in
    if fully != [ ] then head fully else head candidates;
}
