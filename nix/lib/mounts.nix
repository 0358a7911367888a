# Whether an evaluated `fileSystems` holds the mounts a configuration asked for (builtins only; golden-tested in
# nix/tests/golden.nix, applied to the appliance's disk image by checks.appliance-mounts).
#
#   missing WANTED GOT   one line per mount point of WANTED that GOT lacks or has with another device or file system
#                        type, or without one of the wanted mount options; [ ] when GOT holds them all
let
  inherit (builtins)
    attrNames
    concatMap
    elem
    filter
    toJSON
    ;
in
{
  missing =
    wanted: got:
    concatMap (
      mountPoint:
      let
        want = wanted.${mountPoint};
        have = got.${mountPoint};
        differs = field: (want ? ${field}) && (have.${field} or null) != want.${field};
        absentOptions = filter (o: !(elem o (have.options or [ ]))) (want.options or [ ]);
      in
      if !(got ? ${mountPoint}) then
        [ "${mountPoint}: not mounted (wanted ${want.device})" ]
      else
        map (field: "${mountPoint}: ${field} is ${toJSON (have.${field} or null)}, wanted ${toJSON want.${field}}") (
          filter differs [
            "device"
            "fsType"
          ]
        )
        ++ map (o: "${mountPoint}: mounted without option ${o}") absentOptions
    ) (attrNames wanted);
}
