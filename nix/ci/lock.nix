# Tier 2 of nix/ci/check.sh: flake.lock holds one node besides the root, nixpkgs, locked to the revision recorded
# in nix/pins/nixpkgs.nix with a well-formed narHash, and flake.nix asks for that branch and nothing else. Builtins
# only: the lock is read as JSON and nothing is fetched.
#
# Evaluates to a one-line summary, or throws with every disagreement found.
let
  pin = import ../pins/nixpkgs.nix;
  lockFile = ../../flake.lock;
  flakeFile = ../../flake.nix;

  inherit (builtins)
    attrNames
    concatStringsSep
    filter
    fromJSON
    match
    readFile
    toJSON
    ;

  lock = fromJSON (readFile lockFile);
  flake = import flakeFile;
  node = lock.nodes.nixpkgs or { };

  expectLocked = {
    type = "github";
    owner = "NixOS";
    repo = "nixpkgs";
    inherit (pin) rev narHash lastModified;
  };
  expectOriginal = {
    type = "github";
    owner = "NixOS";
    repo = "nixpkgs";
    ref = pin.branch;
  };

  same = what: want: got: if want == got then null else "${what} is ${toJSON got}, expected ${toJSON want}";

  problems = filter (p: p != null) [
    (same "lock version" 7 (lock.version or null))
    (same "lock nodes" [ "nixpkgs" "root" ] (attrNames lock.nodes))
    (same "root inputs" { nixpkgs = "nixpkgs"; } (lock.nodes.root.inputs or null))
    (same "nixpkgs.locked" expectLocked (node.locked or null))
    (same "nixpkgs.original" expectOriginal (node.original or null))
    (
      if match "sha256-[A-Za-z0-9+/]{43}=" (node.locked.narHash or "") != null then
        null
      else
        "narHash ${toJSON (node.locked.narHash or null)} is not an SRI sha256"
    )
    (
      if match "[0-9a-f]{40}" (node.locked.rev or "") != null then
        null
      else
        "rev ${toJSON (node.locked.rev or null)} is not a full commit id"
    )
    (same "flake.nix inputs" [ "nixpkgs" ] (attrNames flake.inputs))
    (same "flake.nix nixpkgs url" "github:NixOS/nixpkgs/${pin.branch}" (flake.inputs.nixpkgs.url or null))
  ];
in
if problems == [ ] then
  "flake.lock: nixpkgs ${pin.branch} at ${pin.rev}, narHash ${pin.narHash}"
else
  throw "flake.lock disagrees with nix/pins/nixpkgs.nix:\n  ${concatStringsSep "\n  " problems}"
