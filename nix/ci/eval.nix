# Tier 5 of nix/ci/check.sh: what the evaluation tier evaluates against the offline nixpkgs tree. A function of the
# flake's outputs, which check.sh gives to `nix eval --apply` over the flake: the evaluation is pure, as that of
# `nix build`, so this file imports nothing and reaches everything through the outputs.
#
# It returns every derivation path it evaluates (no derivation is built); per NixOS configuration, the warnings the
# project raises there on purpose, throwing when a configuration warns otherwise (check.sh then fails on any warning
# printed that is not one of those); and, for the wheels tier, what autoPatchelf is given for each native wheel.
outputs:
let
  inherit (builtins)
    attrNames
    attrValues
    concatStringsSep
    filter
    length
    listToAttrs
    mapAttrs
    parseDrvName
    split
    ;

  system = "x86_64-linux";
  drvPaths = mapAttrs (_: d: d.drvPath);
  appliance = outputs.nixosConfigurations.appliance.config;

  # Each NixOS configuration evaluated, with a phrase (no regular-expression characters) of each warning it raises on
  # purpose: `config.warnings` holds the project's warnings and nixpkgs' modules' alike, so any other is a failure.
  configurations = {
    appliance = {
      config = appliance;
      # the flake's appliance has no SSH key: each user adds their own (README, "The appliance")
      onPurpose = [ "has no SSH key for root" ];
    };
    appliance-image = {
      config = appliance.system.build.images.raw-efi.passthru.config;
      onPurpose = [ "has no SSH key for root" ];
    };
    module-options = {
      inherit (outputs.checks.${system}.module-options) config;
      onPurpose = [ ];
    };
    fleet-options = {
      inherit (outputs.checks.${system}.fleet-options) config;
      onPurpose = [ ];
    };
    # the VM has no GPU, so no NVIDIA driver: it serves the CPU demo engine
    vm-machine = {
      config = outputs.hydraJobs.vm.${system}.config.nodes.machine;
      onPurpose = [ "configures no NVIDIA driver" ];
    };
  };

  # What autoPatchelf is given for each wheel that holds machine code, for nix/ci/wheel_deps.py's dry run of it: the
  # wheel, the build inputs it searches (by pname), the libraries it may leave missing; the sonames of the inputs
  # that are nixpkgs' CUDA packages and the files the CUDA library wheels install; and the text the two patched
  # run-time loaders depend on. The packages are those of the flake's nixpkgs instance, the appliance's.
  py = appliance.nixpkgs.pkgs.glm53.pythonPackages;
  autoPatchelf = d: {
    wheel = d.src.name;
    inputs = map (i: i.pname or (parseDrvName i.name).name) d.buildInputs;
    ignore = d.autoPatchelfIgnoreMissingDeps or [ ];
  };
  wheels = {
    packages = listToAttrs (
      map (name: {
        inherit name;
        value = autoPatchelf py.${name};
      }) (filter (name: py.pins.packages.${name}.native) (attrNames py.pins.packages))
    );
    cudaWheelLibs = mapAttrs (
      name: _: autoPatchelf py.cudaWheelLibs.${name} // py.cudaWheelLibs.${name}.layout
    ) py.pins.libraries;
    cudaPackages = listToAttrs (
      attrValues (
        mapAttrs (attr: l: {
          name = py.torch.cudaPackages.${attr}.pname;
          value = l.sonames;
        }) py.torch.cudaLibraries.nixpkgs
      )
    );
    triton = py.triton.libcudaLookup // {
      wheel = py.triton.src.name;
    };
    cuda-pathfinder = {
      wheel = py.cuda-pathfinder.src.name;
      bindings = py.cuda-bindings.src.name;
      inherit (py.cuda-pathfinder) search libraries elsewhere;
    };
  };

  has = phrase: text: length (split phrase text) > 1;
  checked =
    name:
    { config, onPurpose }:
    let
      unexpected = filter (w: filter (p: has p w) onPurpose == [ ]) config.warnings;
      missing = filter (p: filter (has p) config.warnings == [ ]) onPurpose;
    in
    if unexpected != [ ] || missing != [ ] || length config.warnings != length onPurpose then
      throw ''
        NixOS configuration ${name}: warnings other than the project raises on purpose
          raised: ${concatStringsSep "\n          " config.warnings}
          expected one warning with each of: ${concatStringsSep "; " onPurpose}''
    else
      {
        toplevel = config.system.build.toplevel.drvPath;
        inherit (config) warnings;
        inherit onPurpose;
      };
in
{
  packages = drvPaths outputs.packages.${system};
  devShells = drvPaths outputs.devShells.${system};
  apps = mapAttrs (_: app: app.program) outputs.apps.${system};
  checks = drvPaths outputs.checks.${system};
  hydraJobs = mapAttrs (_: job: job.${system}.drvPath) outputs.hydraJobs;
  nixosConfigurations = mapAttrs (_: c: c.config.system.build.toplevel.drvPath) outputs.nixosConfigurations;
  # nixosModules.default is evaluated in module-options and the appliance
  configurations = mapAttrs checked configurations;
  inherit wheels;
}
