{
  description = "glm53: GLM-5.3-Flash from one 24 GB NVIDIA GPU plus host RAM, behind an OpenAI-compatible API";

  # The only input. flake.lock pins it to the revision recorded, with the origin of its narHash, in
  # nix/pins/nixpkgs.nix; nix/ci/check.sh fails when the two disagree.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";

  # Binary caches for `nix build` and `nix run` of this flake; Nix asks before using a flake's settings
  # (--accept-flake-config takes them). cache.nixos-cuda.org holds nixpkgs' CUDA builds for its default configuration;
  # this project's own packages are in no public cache: add a cache of yours that holds them to both lists (README,
  # "Build cost"; services.glm53.binaryCaches does the same for a NixOS host).
  nixConfig = {
    extra-substituters = [ "https://cache.nixos-cuda.org" ];
    extra-trusted-public-keys = [ "cache.nixos-cuda.org:74DUi4Ye579gUqzH4ziL9IyiJBlDpMRn9MBN8oNan9M=" ];
  };

  outputs =
    { self, nixpkgs }:
    let
      # x86_64 only: the pinned wheels are manylinux x86_64 and the CPU tier is AVX2 code.
      system = "x86_64-linux";
      inherit (nixpkgs) lib;
      pkgs = import ./nix { inherit nixpkgs system; };
      inherit (pkgs) glm53;

      app = name: {
        type = "app";
        program = lib.getExe glm53.${name};
        meta.description = glm53.${name}.meta.description;
      };

      golden = import ./nix/tests/golden.nix;
    in
    {
      overlays.default = import ./nix/overlay.nix;

      packages.${system} = {
        inherit (glm53)
          glm53
          torch
          exllamav3
          serve-fast
          serve-exact
          oci-fast
          oci-exact
          sglang-router
          ;
        appliance-image = self.nixosConfigurations.appliance.config.system.build.images.raw-efi;
        default = glm53.serve-fast;
      };

      # nix run .#serve-fast -- -m /path/to/model (arguments after -- are appended; the last value wins)
      apps.${system} = {
        serve-fast = app "serve-fast";
        serve-exact = app "serve-exact";
        default = app "serve-fast";
      };

      nixosModules.default = import ./nix/module.nix { inherit (self) packages; };
      # services.glm53-router: several appliances behind SGLang's router, with a shared Valkey (README, "Several boxes")
      nixosModules.fleet = import ./nix/fleet.nix { inherit (self) packages; };

      nixosConfigurations.appliance = nixpkgs.lib.nixosSystem {
        modules = [
          self.nixosModules.default
          ./appliance
          # The flake's own instance: its CUDA configuration and overlay, and the same store paths as the packages.
          { nixpkgs.pkgs = pkgs; }
        ];
      };

      devShells.${system}.default = glm53.devShell;

      # Evaluation checks: `nix flake check` builds them in seconds, with no GPU, no KVM and none of the CUDA closure.
      # nix/ci/check.sh evaluates them offline (nix/ci/eval.nix); nix/ci/release-check.sh runs `nix flake check`.
      checks.${system} = {
        golden =
          assert lib.assertMsg (golden.failures == [ ]) (lib.concatStringsSep "\n" golden.failures);
          pkgs.runCommand "glm53-golden" { } "touch $out";
        # The disk image keeps the appliance's file systems, the weights partition among them (appliance/hardware.nix).
        appliance-mounts =
          let
            wanted = import ./appliance/mounts.nix;
            inherit (import ./nix/lib/mounts.nix) missing;
            inherit (self.nixosConfigurations.appliance) extendModules;
            appliance = self.nixosConfigurations.appliance.config;
            # The configuration the image is built from: what nixos/modules/image/images.nix passes through, or the
            # same extension of the appliance by the image's module where a nixpkgs does not pass it.
            image =
              appliance.system.build.images.raw-efi.passthru.config
                or (extendModules { modules = [ appliance.image.modules.raw-efi ]; }).config;
            problems =
              map (p: "toplevel: ${p}") (missing wanted appliance.fileSystems)
              ++ map (p: "raw-efi image: ${p}") (missing wanted image.fileSystems);
          in
          assert lib.assertMsg (problems == [ ]) ''
            file systems of appliance/mounts.nix missing from the appliance:
              ${lib.concatStringsSep "\n  " problems}'';
          pkgs.runCommand "glm53-appliance-mounts" { } "touch $out";
        module-options = pkgs.callPackage ./nix/tests/module-options.nix {
          inherit (nixpkgs.lib) nixosSystem;
          module = self.nixosModules.default;
          packages = self.packages.${system};
        };
        fleet-options = pkgs.callPackage ./nix/tests/fleet-options.nix {
          inherit (nixpkgs.lib) nixosSystem;
          module = self.nixosModules.fleet;
          packages = self.packages.${system};
        };
      };

      # The release builds, `hydraJobs.<job>.<system>` as Hydra names them: `nix flake check` evaluates them and
      # nix/ci/release-check.sh builds them, one step each, on a networked machine (the VM test needs KVM).
      hydraJobs = lib.mapAttrs (_: job: { ${system} = job; }) {
        inherit (glm53) serve-fast serve-exact oci-fast;
        appliance = self.nixosConfigurations.appliance.config.system.build.toplevel;
        inherit (self.packages.${system}) appliance-image;
        # The images must take libcuda.so.1 and libnvidia-ml.so.1 from the host driver: no driver library anywhere in
        # the closure. NVIDIA's link-time stubs, which nixpkgs' cuda_cudart installs in lib/stubs, are allowed
        # (nix/ci/driver-libs.sh tells the two apart; nix/tests/driver-libs.sh is its golden test).
        no-libcuda =
          pkgs.runCommand "glm53-no-libcuda"
            {
              closure = pkgs.closureInfo {
                rootPaths = [
                  glm53.serve-fast
                  glm53.serve-exact
                ];
              };
            }
            ''
              if ! xargs -a "$closure/store-paths" bash ${./nix/ci/driver-libs.sh} >found; then
                echo "driver libraries in the closure:" >&2
                grep '^driver ' found >&2
                exit 1
              fi
              cp found $out
            '';
        vm = import ./nix/tests/vm.nix {
          inherit pkgs;
          module = self.nixosModules.default;
        };
      };
    };
}
