"""The project's CUDA library (``native/ec/expert_cache.cu`` and the headers it includes): the expert cache's
kernels, the CPU tier's device side and the in-band emulation of a slower link, in one file per set of GPUs.

It comes from ``$GLM53_NATIVE_BUILD``, the installed package (built for the GPUs the package was built for) or the
source tree's ``native/build/`` (compiled there with nvcc for this GPU on first use); ``libraries`` says how. It
has a plain C ABI, declared in ``native/ec/expert_cache.h`` (``cuda_binding`` is generated from it), and links the
CUDA runtime dynamically, so it shares the runtime torch has already loaded. Its users are ``offload.ec_native``
(the cache) and ``cpu_tier.device`` (the CPU tier's handoff), which both load it through :func:`library`.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from . import abi, cuda_binding, libraries
from .libraries import NativeBuildError

SOURCE = libraries.SOURCE / "ec" / "expert_cache.cu"
INCLUDED = ("expert_cache.h", "expert_cache_abi.inc", "cpu_tier_device.cuh", "link_emulate.cuh", "prefetch.cuh",
            "../abi.h")  # by SOURCE: a library older than any of them is stale


def sources() -> list[Path]:
    """What the library is built from."""
    return [SOURCE, *(SOURCE.parent / name for name in INCLUDED)]


def build(target: str) -> Path:
    """Compiles the library for one nvcc target (``sm_90``) into the source tree's ``native/build/``.

    :raise NativeBuildError: no nvcc, or the compile failed (its output is in the message).
    """
    nvcc = libraries.find_nvcc()
    if nvcc is None:
        raise NativeBuildError(f"nvcc, which builds {libraries.ec_library_name([target])} from {SOURCE}, is not on PATH, "
                               "in $CUDA_HOME/bin or in /usr/local/cuda/bin")
    return libraries.build_ec(nvcc, SOURCE, libraries.SOURCE / "build", [target])


def locate(capability: tuple[int, int] | None = None) -> Path:
    """The library for a GPU of ``capability`` (default: the current device's), built in the source tree if need be.

    :raise NativeBuildError: none fits and none could be built; the message says where it looked and what to do.
    """
    if capability is None:
        import torch

        capability = torch.cuda.get_device_capability()
    major, minor = capability
    target = f"sm_{major}{minor}"
    fix = (f"To fix: install the CUDA toolkit (nvcc) and, for an installed package, rebuild it with {major}.{minor} in "
           f"TORCH_CUDA_ARCH_LIST (Nix: nixpkgs' config.cudaCapabilities); or put a library built for this GPU in "
           f"${libraries.OVERRIDE_ENV}, e.g. `nvcc -O3 -arch={target} -shared -Xcompiler -fPIC -cudart shared "
           f"-o {libraries.ec_library_name([target])} native/ec/expert_cache.cu`.")
    return libraries.find_or_build(f"expert-cache CUDA library ({libraries.EC_PREFIX}*.so) for compute capability {major}.{minor}",
                                   lambda files: libraries.pick_ec(files, (major, minor)), sources(), lambda: build(target), fix)


def library(path: Path | None = None) -> tuple[ctypes.CDLL, Path]:
    """The loaded library at ``path`` (default: :func:`locate`'s for the current GPU), its functions' signatures set
    from ``cuda_binding``, and its path.

    :raise NativeBuildError: none found or built. :raise AbiMismatch: its structs, numbers or functions are not the
        binding's (a stale build).
    """
    path = Path(path) if path is not None else locate()
    return _load(path), path


@cache
def _load(path: Path) -> ctypes.CDLL:
    return abi.bind(ctypes.CDLL(str(path)), path, cuda_binding)


def checked(lib: ctypes.CDLL, code: int) -> None:
    """Raises the library's own message for an entry point's nonzero return ``code``.

    :raise NativeError: ``ec_error()``'s sentence: the function, and the argument it refused and why, or CUDA's error.
    """
    if code != 0:
        raise abi.NativeError(lib.ec_error().decode())
