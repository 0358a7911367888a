# serve-fast and serve-exact: one closure (Python 3.13 with glm53 and its pinned dependencies), two wrappers that
# differ only in what nix/lib/wrapper.nix gives them.
{
  lib,
  runCommand,
  makeWrapper,
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
      --add-flags ${lib.escapeShellArg (lib.escapeShellArgs wrapper.flags)} \
      ${lib.concatStringsSep " " (
        lib.mapAttrsToList (name: value: "--set-default ${name} ${lib.escapeShellArg value}") wrapper.defaults
      )}
  ''
