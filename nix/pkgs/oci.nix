# oci-fast / oci-exact: a layered OCI image of serve-fast / serve-exact, streamed rather than stored (the closure of
# torch and the CUDA libraries is several GB; a stored tarball would be a second copy in the store):
#
#   $(nix build .#oci-fast --print-out-paths) | docker load
#
# The image holds no NVIDIA driver library: libcuda.so.1 is the host's, mounted by the NVIDIA container toolkit
# (nix/lib/image.nix sets the search path), and the flake's no-libcuda check keeps it out of the closure.
{
  lib,
  dockerTools,
  cacert,
  serve,
}:
let
  image = import ../lib/image.nix {
    inherit (serve) mode version;
    entrypoint = lib.getExe serve;
    caBundle = "${cacert}/etc/ssl/certs/ca-bundle.crt";
  };
in
dockerTools.streamLayeredImage {
  inherit (image) name tag config;
  # /etc/passwd and /etc/group: Python's getpass (used by torch for cache paths) needs the user to exist.
  contents = [ dockerTools.fakeNss ];
  # Writable state, cache and /tmp. The empty ld.so.conf is for the container toolkit's legacy hook, which runs
  # ldconfig on the image after mounting the driver; Nix programs ignore the cache it writes and use
  # LD_LIBRARY_PATH instead.
  fakeRootCommands = ''
    mkdir -p tmp var/lib/glm53 var/cache/glm53 etc
    chmod 1777 tmp
    touch etc/ld.so.conf
  '';
  enableFakechroot = false;
  # Roughly one layer per store path, so a rebuild of glm53 alone changes a few small layers.
  maxLayers = 100;
}
