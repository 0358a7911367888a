# Where torch's CUDA libraries come from, decided from nix/pins/torch-cuda.json (nix/pins/torch_cuda.py's record of
# what the pinned torch wheel imports from each library, and which builds of it export all of that) and the pins.
# Builtins only: golden-tested in nix/tests/golden.nix, used by nix/pkgs/torch.nix.
#
#   wheels     CUDA wheel pinned under "libraries" -> { version; sonames; }: torch is linked against its libraries
#   nixpkgs    cudaPackages attribute -> { sonames; versions; }: torch is linked against nixpkgs' package, which must
#              be at one of `versions` (the builds that export every symbol torch imports; torch.nix asserts it)
#   releases   the CUDA 13.2 releases whose builds of all the `nixpkgs` libraries satisfy torch
#   problems   every way the record and the pins disagree; [ ] when they agree
{
  record ? builtins.fromJSON (builtins.readFile ../pins/torch-cuda.json),
  pins ? import ./pins.nix { },
}:
let
  inherit (builtins)
    all
    attrNames
    concatMap
    concatStringsSep
    elem
    filter
    head
    listToAttrs
    ;

  libraries = record.libraries;
  sonames = attrNames libraries;
  linked = so: pins.libraries ? ${libraries.${so}.wheel};
  # What the pins hold for a library's wheel: the linked wheel's version, or the version pip resolved next to torch.
  pinnedVersion =
    so:
    let
      wheel = libraries.${so}.wheel;
    in
    if linked so then pins.libraries.${wheel}.version else pins.replaced.${wheel} or null;
  satisfies = version: so: (libraries.${so}.missing.${version} or null) == [ ];

  # The distinct values of one field over some sonames, in order.
  namesOf =
    field: sos:
    builtins.foldl' (kept: n: if elem n kept then kept else kept ++ [ n ]) [ ] (
      map (so: libraries.${so}.${field}) sos
    );
  sonamesOf = field: name: filter (so: libraries.${so}.${field} == name) sonames;

  fromWheels = filter linked sonames;
  fromNixpkgs = filter (so: !linked so) sonames;

  wheels = listToAttrs (
    map (wheel: {
      name = wheel;
      value = {
        inherit (pins.libraries.${wheel}) version;
        sonames = sonamesOf "wheel" wheel;
      };
    }) (namesOf "wheel" fromWheels)
  );

  nixpkgs = listToAttrs (
    map (
      attr:
      let
        own = sonamesOf "nixpkgs" attr;
      in
      {
        name = attr;
        value = {
          sonames = own;
          # A build counts only if it was checked for every soname the package provides (libcublas has two).
          versions = filter (v: all (satisfies v) own) (attrNames libraries.${head own}.missing);
        };
      }
    ) (namesOf "nixpkgs" fromNixpkgs)
  );

  releases = filter (
    release:
    all (so: satisfies (record.cudaReleases.${release}.${libraries.${so}.wheel} or "unknown") so) fromNixpkgs
  ) (attrNames record.cudaReleases);

  describe = so: "${libraries.${so}.wheel} ${toString (pinnedVersion so)} (${so})";
  problems =
    (
      if record.torch.sha256 == pins.packages.torch.sha256 then
        [ ]
      else
        [
          "nix/pins/torch-cuda.json was recorded for ${record.torch.filename} (sha256 ${record.torch.sha256}), not the pinned torch; rerun nix/pins/torch_cuda.py"
        ]
    )
    ++ concatMap (
      so:
      if pinnedVersion so != libraries.${so}.required then
        [
          "${so}: the record checked torch against ${libraries.${so}.wheel} ${libraries.${so}.required}, the pins hold ${toString (pinnedVersion so)}; rerun nix/pins/torch_cuda.py"
        ]
      else if !(satisfies (pinnedVersion so) so) then
        [
          "${describe so} lacks symbols torch imports: ${concatStringsSep ", " libraries.${so}.missing.${pinnedVersion so}}"
        ]
      else
        [ ]
    ) sonames
    ++ map (
      attr: "cudaPackages.${attr}: no build checked satisfies torch; pin its wheel under libraries (nix/pins/update.py LINKED)"
    ) (filter (attr: nixpkgs.${attr}.versions == [ ]) (attrNames nixpkgs));
in
{
  inherit
    wheels
    nixpkgs
    releases
    problems
    ;
}
