"""A Python stand-in for exllamav3's ``exl3_moe_cpu_core_order``, for stock exllamav3's CPU-offload baselines.

On the GPU test machine the prebuilt ``exllamav3_ext`` crashes (SIGSEGV) in ``physical_core_order()``: it reads
``/sys/devices/system/cpu/cpuN/topology/*`` through a statically linked libstdc++ whose locale facets clash with
the one torch loads (``../shared/device/README.md``). Stock ``-mcs``/``-mcpa`` call it at import time of
``exllamav3.model.moe_cpu_host`` (``TUNING = MoeCpuTuning()``), in the parent and again in the CPU worker, which
``multiprocessing`` starts with the ``spawn`` method (a fresh interpreter). So the replacement has to be in place
before that module is imported in both processes: ``bench/mcs_shim/sitecustomize.py``, on ``PYTHONPATH`` of an
arm's subprocess only, calls ``install_import_hook`` at interpreter start, and the spawned worker inherits the
environment. ``EXL3_MOE_CPU_PIN=0`` is needed as well: the worker pool's own pinning calls the C++ function.

``core_order`` returns what the C++ function returns on Linux (exllamav3 1.6.5,
``exllamav3_ext/cpu/moe_mul1.cpp``, ``physical_core_order`` and ``exl3_moe_cpu_core_order``): the logical CPUs
0..n-1 with one CPU per distinct ``(physical_package_id, core_id)`` first, in CPU order, then every SMT sibling in
CPU order; and the count of the first group. A CPU whose ``core_id`` cannot be read counts as a core of its own.
The opt-in ``EXL3_MOE_CPU_SPREAD`` (round-robin over L3 domains) is not reproduced.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")
EXT_MODULE = "exllamav3.ext"  # binds the compiled extension as ``exllamav3_ext``, prebuilt or JIT-built
PATCHED = "exl3_moe_cpu_core_order"


def _read_int(path: Path) -> int:
    """The integer in a sysfs file; -1 where it is missing or unreadable (as the C++ reader leaves it)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


def core_order(root: Path = SYSFS_CPU, ncpu: int | None = None) -> tuple[list[int], int]:
    """(logical CPUs, one per physical core first then their SMT siblings; number of physical cores).

    :param root: the sysfs CPU directory (tests pass a fake tree).
    :param ncpu: CPUs to look at, 0..ncpu-1; default ``os.cpu_count()`` (the C++ code takes
        ``std::thread::hardware_concurrency()``, the same online-CPU count).
    """
    if ncpu is None:
        ncpu = os.cpu_count() or 1
    firsts: list[int] = []
    siblings: list[int] = []
    seen: set[tuple[int, int]] = set()
    for cpu in range(ncpu):
        topology = Path(root) / f"cpu{cpu}" / "topology"
        core = _read_int(topology / "core_id")
        if core < 0:
            firsts.append(cpu)
            continue
        key = (_read_int(topology / "physical_package_id"), core)
        if key in seen:
            siblings.append(cpu)
        else:
            seen.add(key)
            firsts.append(cpu)
    return firsts + siblings, len(firsts)


def patch_extension(ext) -> None:
    """Replace the extension module's function (callers look it up on the module at each call)."""
    setattr(ext, PATCHED, core_order)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``exllamav3.ext`` through the other finders and patches the extension as soon as it has loaded,
    before any other exllamav3 module can call the function."""

    def find_spec(self, name, path, target=None):
        if name != EXT_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module, _original=original):
            _original(module)
            patch_extension(module.exllamav3_ext)

        loader.exec_module = exec_module  # this loader instance serves this one spec
        return spec


def install_import_hook() -> None:
    """Patch ``exllamav3_ext`` when ``exllamav3.ext`` is imported (now, if it already was)."""
    if EXT_MODULE in sys.modules:
        patch_extension(sys.modules[EXT_MODULE].exllamav3_ext)
        return
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
