"""The generated bindings (``bindgen``: ``cpu_binding``, ``cuda_binding``) applied to a loaded library and checked
against it: each library's headers declare one ``<prefix>_abi(name, &value)`` each (``native/abi.h``), which reports
the ``sizeof`` and ``offsetof`` its compiler used and the value of every number, and :func:`bind` compares the
binding's ``ctypes`` mirrors and constants with them before it sets every signature.

    lib = bind(ctypes.CDLL(str(path)), path, cpu_binding)

A library built from other sources than the Python that loads it (an older build in ``$GLM53_NATIVE_BUILD``, a
header changed without ``make bindings``) then fails at load, naming each difference, instead of reading the wrong
bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

from .libraries import NativeBuildError

_STALE = "does not match this glm53 (rebuild it from this source tree, or put a matching build in $GLM53_NATIVE_BUILD)"


class AbiMismatch(NativeBuildError):
    """The library's structs or numbers are not what this Python mirrors; the message lists every difference."""


class NativeError(RuntimeError):
    """A native entry point refused its arguments or failed; the message is the library's, naming the function and
    the argument."""


def bind(lib: ctypes.CDLL, path: Path | str, binding: ModuleType) -> ctypes.CDLL:
    """Sets the restype and argtypes of every function the ``binding`` declares (a module ``bindgen`` generated) on
    ``lib`` and checks the binding's structs and numbers against each ``<prefix>_abi`` of the library.

    :raise AbiMismatch: a function, size, offset or number of the binding is not the library's (a stale build).
    """
    missing = [name for name in binding.FUNCTIONS if not hasattr(lib, name)]
    if missing:
        raise AbiMismatch(f"{path} {_STALE}: it lacks {', '.join(missing)}")
    for name, (restype, argtypes) in binding.FUNCTIONS.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    for name, (structs, values) in binding.ABI.items():
        check(getattr(lib, name), path, structs, values)
    return lib


def names(group: Mapping[str, int], prefix: str, count: str | None = None) -> tuple[str, ...]:
    """The lower-case names, without ``prefix``, of an enum's members numbered 0, 1, 2 ... (in that order), below
    the member ``count`` (the number of them, left out); negative members (a "best" choice, an error) are left out.
    ``names(cpu_binding.glm53_ce_isa, "GLM53_CE_ISA_", "GLM53_CE_ISA_COUNT")`` is ``("scalar", "avx2", "avx512",
    "avx512vbmi")``.

    :raise ValueError: the members are not numbered 0, 1, 2 ... or do not all start with ``prefix``.
    """
    limit = group[count] if count is not None else None
    members = sorted((v, n) for n, v in group.items() if v >= 0 and (limit is None or v < limit))
    if [v for v, _ in members] != list(range(len(members))) or not all(n.startswith(prefix) for _, n in members):
        raise ValueError(f"the members {[n for _, n in members]} are not {prefix}* numbered 0, 1, 2 ...")
    return tuple(n[len(prefix):].lower() for _, n in members)


def lookup(function) -> Callable[[str], int | None]:
    """``name -> value`` (None when the library does not know the name) over a library's ``<prefix>_abi`` (its
    signature set by :func:`bind`)."""

    def value(name: str) -> int | None:
        out = ctypes.c_int64()
        return int(out.value) if function(name.encode(), ctypes.byref(out)) == 0 else None

    return value


def differences(value: Callable[[str], int | None], structs: Mapping[str, type[ctypes.Structure]],
                values: Mapping[str, int]) -> list[str]:
    """What differs between the mirrors and the library: per struct its size and each field's offset (by the
    field's name in the mirror, which is its name in C), then each expected number."""
    found = []

    def compare(name: str, mine: int) -> None:
        theirs = value(name)
        if theirs is None:
            found.append(f"{name}: unknown to the library (here {mine})")
        elif theirs != mine:
            found.append(f"{name}: {theirs} there, {mine} here")

    for c_name, struct in structs.items():
        compare(c_name, ctypes.sizeof(struct))
        for field in struct._fields_:
            compare(f"{c_name}.{field[0]}", getattr(struct, field[0]).offset)
    for name, mine in values.items():
        compare(name, mine)
    return found


def check(function, path: Path | str, structs: Mapping[str, type[ctypes.Structure]] = {},  # noqa: B006 (read only)
          values: Mapping[str, int] = {}) -> None:  # noqa: B006
    """Check the mirrors against the library's ``<prefix>_abi`` ``function``.

    :raise AbiMismatch: a size, offset or number differs or is unknown to the library; the message names the
        library and every difference, and says to rebuild it.
    """
    found = differences(lookup(function), structs, values)
    if found:
        raise AbiMismatch(f"{path} {_STALE}: " + "; ".join(found))
