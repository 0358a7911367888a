# nix/pins/pypi.json (written by nix/pins/update.py) as the fetchers and the wheel builder take it.
#
# Builtins only, so that nix/ci/check.sh evaluates it without nixpkgs. Every pin is checked when it is read, and a
# bad one stops evaluation instead of fetching something else: the file must be a wheel whose name is a valid store
# path name, the URL must be content-addressed on files.pythonhosted.org and end in that name, the digest must be 64
# hex digits, the SRI hash must hold the same digest (checked with builtins.convertHash where Nix has it, 2.19 and
# later), and every dependency must itself be pinned. The CUDA library wheels ("libraries") are checked alike.
{
  file ? ../pins/pypi.json,
}:
let
  inherit (builtins)
    attrNames
    concatStringsSep
    filter
    fromJSON
    hasAttr
    match
    readFile
    stringLength
    substring
    ;

  data = fromJSON (readFile file);
  filesHost = "https://files.pythonhosted.org/packages/";

  hasPrefix = prefix: s: substring 0 (stringLength prefix) s == prefix;
  hasSuffix =
    suffix: s:
    let
      n = stringLength s;
      k = stringLength suffix;
    in
    n >= k && substring (n - k) k s == suffix;

  sriOf =
    hex:
    builtins.convertHash {
      hash = hex;
      hashAlgo = "sha256";
      toHashFormat = "sri";
    };

  problemsOf =
    name: pin:
    let
      hexOk = match "[0-9a-f]{64}" pin.sha256 != null;
    in
    filter (p: p != null) [
      (if match "[A-Za-z0-9+._-]+\\.whl" pin.filename != null then null else "file ${pin.filename} is not a wheel with a store-safe name")
      (if hasPrefix filesHost pin.url then null else "URL ${pin.url} is not under ${filesHost}")
      (if hasSuffix "/${pin.filename}" pin.url then null else "URL ${pin.url} does not end in /${pin.filename}")
      (if hexOk then null else "sha256 ${pin.sha256} is not 64 hex digits")
      (if match "sha256-[A-Za-z0-9+/]{43}=" pin.hash != null then null else "hash ${pin.hash} is not an SRI sha256")
      (
        # convertHash aborts evaluation (uncatchably) on malformed input, so only a well-formed digest reaches it.
        if !hexOk || !(builtins ? convertHash) || sriOf pin.sha256 == pin.hash then
          null
        else
          "hash ${pin.hash} is not sha256 ${pin.sha256}"
      )
    ]
    ++ map (dep: "depends on ${dep}, which is not pinned") (
      filter (dep: !(hasAttr dep data.packages)) (pin.deps or [ ])
    );

  checked =
    name: pin:
    let
      problems = problemsOf name pin;
    in
    if problems == [ ] then
      pin
    else
      throw "${toString file}: ${name}: ${concatStringsSep "; " problems}";

  unpinnedRoots = filter (name: !(hasAttr name data.packages)) (data.roots.runtime ++ data.roots.dev);
in
if unpinnedRoots != [ ] then
  throw "${toString file}: roots not pinned: ${concatStringsSep ", " unpinnedRoots}"
else
  data
  // {
    packages = builtins.mapAttrs (
      name: pin:
      checked name pin
      // {
        pname = name;
        # A wheel tagged none-any holds no machine code, so it needs no ELF patching.
        native = !(hasSuffix "-none-any.whl" pin.filename);
      }
    ) data.packages;
    names = attrNames data.packages;
    # CUDA wheels whose shared libraries torch is linked against (nix/pkgs/cuda-wheel-libs.nix), checked the same way.
    libraries = builtins.mapAttrs checked (data.libraries or { });
  }
