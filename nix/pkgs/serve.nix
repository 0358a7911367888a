# serve-fast and serve-exact: one closure (Python 3.13 with glm53 and its pinned dependencies), two wrappers that
# differ only in what nix/lib/wrapper.nix gives them. Both find the host's NVIDIA driver first (host-driver.sh), so
# that `nix run .#serve-fast` works on Ubuntu, Fedora or Arch as on NixOS.
{
  lib,
  runCommand,
  makeWrapper,
  replaceVars,
  coreutils,
  stdenv,
  python,
  glm53,
  mode,
}:
let
  env = python.withPackages (_: [ glm53 ]);
  wrapper = import ../lib/wrapper.nix {
    inherit mode;
    cc = "${stdenv.cc}/bin/cc";
  };
  hostDriver = replaceVars ./host-driver.sh { inherit coreutils; };
in
runCommand "${wrapper.name}-${glm53.version}"
  {
    nativeBuildInputs = [ makeWrapper ];
    passthru = {
      inherit env mode;
      inherit (glm53) version;
    };
    meta = {
      description = "GLM-5.3-Flash on one NVIDIA GPU plus host RAM, OpenAI-compatible API (${mode} mode)";
      mainProgram = wrapper.name;
      license = lib.licenses.asl20;
      platforms = [ "x86_64-linux" ];
    };
  }
  ''
    makeWrapper ${env}/bin/glm53 "$out/bin/${wrapper.name}" \
      --run ${lib.escapeShellArg ". ${hostDriver}; glm53_host_driver ${wrapper.name}"} \
      --add-flags ${lib.escapeShellArg (lib.escapeShellArgs wrapper.flags)} \
      ${lib.concatStringsSep " " (
        lib.mapAttrsToList (name: value: "--set-default ${name} ${lib.escapeShellArg value}") wrapper.defaults
      )}
  ''
