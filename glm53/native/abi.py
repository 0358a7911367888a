"""The ctypes mirrors of the native libraries' structs, and the numbers both sides give to states, ids and limits,
checked against the compiled library: each library exports ``<prefix>_abi(name, &value)`` (``native/abi.h``) with
the ``sizeof`` and ``offsetof`` its compiler used, and a loader calls :func:`check` before it passes a struct.

    check(lib.glm53_ce_abi, path, structs={"glm53_ce_linear": _CLinear}, values={"limit.max_rows": 8})

A library built from other sources than the Python that loads it (an older build in ``$GLM53_NATIVE_BUILD``, a
header changed without the mirror) then fails at load, naming each difference, instead of reading the wrong bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from pathlib import Path

from .libraries import NativeBuildError


class AbiMismatch(NativeBuildError):
    """The library's structs or numbers are not what this Python mirrors; the message lists every difference."""


def lookup(function) -> Callable[[str], int | None]:
    """``name -> value`` (None when the library does not know the name) over a library's ``<prefix>_abi``."""
    function.restype, function.argtypes = ctypes.c_int32, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)]

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
          values: Mapping[str, int] = {}) -> Callable[[str], int | None]:  # noqa: B006
    """Check the mirrors against the library's ``<prefix>_abi`` ``function``; returns the lookup, for the numbers
    the caller reads from the library rather than mirrors.

    :raise AbiMismatch: a size, offset or number differs or is unknown to the library; the message names the
        library and every difference, and says to rebuild it.
    """
    value = lookup(function)
    found = differences(value, structs, values)
    if found:
        raise AbiMismatch(f"{path} does not match this glm53 (rebuild it from this source tree, or put a matching build in "
                          f"$GLM53_NATIVE_BUILD): " + "; ".join(found))
    return value
