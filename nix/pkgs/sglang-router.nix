# sglang-router: SGLang's router (a Rust load balancer in a Python wheel), the fleet's router (nix/fleet.nix). Not in
# nixpkgs, so the wheel comes from PyPI pinned by hash; its Python launcher's imports come from nixpkgs. The same
# version as pyproject.toml's fleet extra, which the fleet tests run.
{
  lib,
  stdenv,
  fetchurl,
  autoPatchelfHook,
  python,
}:
python.pkgs.buildPythonPackage rec {
  pname = "sglang-router";
  version = "0.3.2";
  format = "wheel";
  src = fetchurl {
    url = "https://files.pythonhosted.org/packages/21/37/2ec21a57e77f7bb66c713a819ea6ffa94b6859c6b3ddd062d3b91d856b86/sglang_router-${version}-cp38-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl";
    hash = "sha256-uloklR5eA1f+OQeC/NGr2GFEiochaDLb8uUBod0VSOs=";
  };
  # the Rust library needs libstdc++ and libgcc_s besides glibc
  nativeBuildInputs = [ autoPatchelfHook ];
  buildInputs = [ stdenv.cc.cc.lib ];
  dependencies = with python.pkgs; [
    setproctitle
    aiohttp
    orjson
    uvicorn
    fastapi
  ];
  pythonImportsCheck = [ "sglang_router" ];
  meta = {
    description = "SGLang's model gateway: cache-aware routing over OpenAI-compatible workers";
    homepage = "https://pypi.org/project/sglang-router/${version}/";
    license = lib.licenses.asl20;
    mainProgram = "sglang-router";
    platforms = [ "x86_64-linux" ];
    sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
  };
}
