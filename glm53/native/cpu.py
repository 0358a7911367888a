"""The project's CPU library (``native/``: the expert kernel, the CPU tier's handoff, the disk reader), found or
built as ``libraries`` says, and loaded once with every signature of its binding (``cpu_binding``, generated from
its headers) set and checked. Its users are ``cpu_tier.kernel``, ``cpu_tier.worker`` and ``offload.disk``.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from . import abi, cpu_binding, libraries

SOURCE_DIRS = ("cpu_expert", "cpu_tier", "disk")  # all built into the one library


def sources(native: Path = libraries.SOURCE) -> list[Path]:
    """What the library is built from: a build older than any of them is stale."""
    dirs = [native / d for d in SOURCE_DIRS]
    return [native / "Makefile", native / "abi.h", *(f for d in dirs if d.is_dir() for f in sorted(d.iterdir()))]


def locate(native: Path = libraries.SOURCE, library: Path | None = None) -> Path:
    """The library to load, built with ``make -C native`` in the source tree if need be.

    :raise NativeBuildError: found nowhere and not built; the message says where it looked and what to do.
    """
    library = library or native / "build" / libraries.CPU_LIBRARY
    fix = (f"To fix: reinstall glm53 with g++ and make present (the package build compiles it), or put a "
           f"{libraries.CPU_LIBRARY} built with `make -C native` in ${libraries.OVERRIDE_ENV}.")
    return libraries.find_or_build(libraries.CPU_LIBRARY, libraries.named(libraries.CPU_LIBRARY), sources(native),
                                   lambda: libraries.build_cpu(native, library), fix)


@cache
def library() -> ctypes.CDLL:
    """The loaded library (:func:`locate`'s), its functions' signatures set from ``cpu_binding``.

    :raise NativeBuildError: found nowhere and not built. :raise AbiMismatch: its structs, numbers or functions are
        not the binding's (a stale build).
    """
    path = locate()
    return abi.bind(ctypes.CDLL(str(path)), path, cpu_binding)
