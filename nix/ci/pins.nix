# Tier 4 of nix/ci/check.sh, builtins only.
#
#   requirements   pyproject.toml still asks for what nix/pins/pypi.json was generated from (throws otherwise)
#   fetch          every pin (the CUDA library wheels too) as a fixed-output derivation made by Nix's own fetcher, <nix/fetchurl.nix> (the
#                  builtin:fetchurl that nixpkgs' fetchurl bootstraps from): building it downloads the file from
#                  its content-addressed URL and fails unless the file's sha256 is the pinned one
{
  pinsFile ? ../pins/pypi.json,
  pyprojectFile ? ../../pyproject.toml,
}:
let
  inherit (builtins)
    concatStringsSep
    fromTOML
    mapAttrs
    readFile
    toJSON
    ;

  pins = import ../lib/pins.nix { file = pinsFile; };
  project = (fromTOML (readFile pyprojectFile)).project;
  extras = project.optional-dependencies or { };

  # The same groups nix/pins/update.py reads.
  asked = {
    runtime = (project.dependencies or [ ]) ++ extras.serve ++ extras.gpu ++ extras.hub;
    dev = extras.dev;
  };
in
{
  requirements =
    if asked == pins.requirements then
      "pyproject.toml asks for what nix/pins/pypi.json pins (${toString (builtins.length pins.names)} packages, ${toString (builtins.length (builtins.attrNames pins.libraries))} CUDA library wheels)"
    else
      throw (concatStringsSep "\n" [
        "pyproject.toml's requirements changed since nix/pins/pypi.json was generated;"
        "run `python3 nix/pins/update.py` and commit the new pins."
        "  pyproject.toml: ${toJSON asked}"
        "  pins:           ${toJSON pins.requirements}"
      ]);

  fetch = mapAttrs (
    _: pin:
    import <nix/fetchurl.nix> {
      inherit (pin) url hash;
      name = pin.filename;
    }
  ) (pins.packages // pins.libraries);
}
