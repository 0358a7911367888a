# The GPUs the CUDA code is compiled for, as data (builtins only; golden-tested in nix/tests/golden.nix).
let
  inherit (builtins)
    concatStringsSep
    elem
    filter
    foldl'
    match
    replaceStrings
    ;

  checked =
    capabilities:
    let
      bad = filter (c: match "[0-9]+\\.[0-9]+[af]?" c == null) capabilities;
    in
    if capabilities == [ ] then
      throw "no CUDA capabilities given: set nixpkgs' config.cudaCapabilities, e.g. [ \"8.9\" ]"
    else if bad != [ ] then
      throw "not CUDA capabilities: ${concatStringsSep ", " bad} (expected MAJOR.MINOR, e.g. \"8.9\" or \"9.0a\")"
    else
      capabilities;

  unique = foldl' (kept: c: if elem c kept then kept else kept ++ [ c ]) [ ];
in
{
  # Ampere consumer (RTX 30), Ada (RTX 40, L4, L40), Hopper (H100, H200), Blackwell consumer (RTX 50). Each one
  # multiplies the nvcc time of exllamav3's 177 kernel files; override with nixpkgs' config.cudaCapabilities.
  defaultCapabilities = [
    "8.6"
    "8.9"
    "9.0"
    "12.0"
  ];

  # TORCH_CUDA_ARCH_LIST for torch.utils.cpp_extension (and glm53's setup.py): machine code (SASS) for each capability
  # and no "+PTX", so a GPU outside the list fails at its first kernel launch instead of running driver-JIT-compiled
  # code that nobody measured.
  torchArchList = capabilities: concatStringsSep ";" (checked capabilities);

  # The file glm53's package build makes for the expert cache's kernels from that TORCH_CUDA_ARCH_LIST: one library
  # with machine code for each capability, named for them (glm53/native/libraries.py: ec_library_name, cuda_targets).
  ecLibrary =
    capabilities:
    "libglm53_ec_${
      concatStringsSep "-" (map (c: "sm_" + replaceStrings [ "." ] [ "" ] c) (unique (checked capabilities)))
    }.so";
}
