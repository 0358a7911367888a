# What makes serve-fast and serve-exact different programs over one closure: the arguments their wrappers put in
# front of the user's, and the environment defaults they set. nix/pkgs/serve.nix turns this into makeWrapper flags.
#
# Builtins only (golden-tested in nix/tests/golden.nix).
{
  mode,
  # the C compiler Triton runs at run time to build its kernel launchers
  cc,
}:
assert builtins.elem mode [
  "fast"
  "exact"
];
{
  name = "serve-${mode}";
  # The user's arguments follow these, and the server takes the last value of a repeated flag, so
  # `nix run .#serve-fast -- --port 8000` overrides the port and even `--mode` can be overridden this way.
  flags = [
    "serve"
    "--mode"
    mode
  ];
  # Set only where the environment does not set them already.
  defaults = {
    # A packaged server serves the model or fails loudly; the CPU demo model is `--engine tiny`, asked for by name.
    GLM53_ENGINE = "exl3";
    CC = cc;
  };
}
