# NixOS VM test of services.glm53, run by nix/ci/release-check.sh (needs a Linux builder with KVM). A VM has no
# GPU, so the unit serves the CPU demo engine; everything else is the production unit: it must turn active only
# once /health answers, answer the OpenAI API, and keep its hardening.
{
  pkgs,
  module,
}:
# The node's platform is that of pkgs: runNixOSTest hands pkgs to the node and makes the nixpkgs.* options
# read-only (nixos/modules/misc/nixpkgs/read-only.nix sets nixpkgs.hostPlatform from pkgs), so the node cannot set
# nixpkgs.hostPlatform itself (a second definition of a read-only option is an error). It is asserted here instead.
assert pkgs.stdenv.hostPlatform.system == "x86_64-linux";
pkgs.testers.runNixOSTest {
  name = "glm53-service";

  nodes.machine = {
    imports = [ module ];
    services.glm53 = {
      enable = true;
      extraArgs = [
        "--engine"
        "tiny"
      ];
    };
    environment.systemPackages = [ pkgs.curl ];
    virtualisation.memorySize = 4096;
    virtualisation.cores = 2;
  };

  testScript = ''
    machine.wait_for_unit("glm53.service")
    machine.succeed("curl --fail --silent http://127.0.0.1:30000/health")
    models = machine.succeed("curl --fail --silent http://127.0.0.1:30000/v1/models")
    assert '"glm-5.3-flash"' in models, models
    pid = machine.succeed("systemctl show --property MainPID --value glm53").strip()
    machine.succeed(f"grep -E '^Max locked memory +unlimited' /proc/{pid}/limits")
    machine.succeed("test \"$(systemctl show --property DynamicUser --value glm53)\" = yes")
    # loopback only, unless the host option says otherwise
    machine.succeed("ss -ltnH 'sport = :30000' | grep -q '127.0.0.1:30000'")
  '';
}
