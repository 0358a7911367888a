"""The pick file of pinned Triton autotune picks (``GLM53_TRITON_PIN``): reading, checking, writing.

File format (``version`` 1)::

    {"format": "glm53-triton-pins", "version": 1,
     "gpu": {"name": "NVIDIA H200", "capability": [9, 0]},
     "triton": "3.6.0", "exllamav3": "1.6.5", "torch": "...", "recorded": {...}, "strict": false,
     "kernels": {"exllamav3.vendor.fla.l2norm:l2norm_fwd_kernel": [
         {"key": [128, 1, "torch.bfloat16", "torch.bfloat16", "torch.float32"],
          "config": {"kwargs": {"BT": 16}, "num_warps": 4, "num_stages": 3, "num_ctas": 1}}]}}

A kernel is ``module:qualified name`` of its Python function. A key is Triton's key tuple as a JSON list: ints,
floats, strings, booleans and null as themselves, and tagged one-entry objects for the rest (``{"tuple": [...]}``,
``{"list": [...]}``, ``{"dtype": "torch.float16"}``, ``{"float": "inf"}``). Keys are matched on this encoding, so
``True`` and ``1`` are different keys. ``maxnreg`` appears only when set. ``recorded`` and ``torch`` are for
people; a ``triton`` or ``exllamav3`` version other than the running one, and a GPU of another compute
capability, are refused (a config another build compiled may round differently).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "glm53-triton-pins"
VERSION = 1


class PinFileError(ValueError):
    """The pick file is malformed or does not fit this exllamav3; the message names the file and the field."""


class ArchitectureMismatch(PinFileError):
    """The pick file was recorded on a GPU of another compute capability."""


class VersionMismatch(PinFileError):
    """The pick file was recorded with another triton or exllamav3 than the running one."""


# --- keys and configs as JSON


def encode_value(value: Any) -> Any:
    """One element of an autotune key as JSON (see the module docstring).

    :raise TypeError: a value of a type that cannot be written reversibly.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else {"float": repr(f)}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return {"list": [encode_value(v) for v in value]}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"dtype": str(value)}
    raise TypeError(f"an autotune key holds a {type(value).__module__}.{type(value).__qualname__} ({value!r}), which a pick file cannot hold")


def encode_key(key: tuple) -> list:
    return [encode_value(v) for v in key]


def decode_value(value: Any, where: str) -> Any:
    """The inverse of ``encode_value``. :raise PinFileError: naming ``where``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag in ("tuple", "list") and isinstance(inner, list):
            items = [decode_value(v, f"{where}.{tag}[{i}]") for i, v in enumerate(inner)]
            return tuple(items) if tag == "tuple" else items
        if tag == "dtype" and isinstance(inner, str) and inner.startswith("torch."):
            import torch

            dtype = getattr(torch, inner[len("torch."):], None)
            if isinstance(dtype, torch.dtype):
                return dtype
        if tag == "float" and inner in ("inf", "-inf", "nan"):
            return float(inner)
    raise PinFileError(f"{where}: {json.dumps(value)} is not a key value (expected a number, string, boolean, null, "
                       'or {"tuple": [...]}, {"list": [...]}, {"dtype": "torch.NAME"}, {"float": "inf"})')


def key_text(encoded: list) -> str:
    """The text two keys are matched on."""
    return json.dumps(encoded, sort_keys=True, separators=(",", ":"))


def config_fields(config) -> dict:
    """A ``triton.Config`` as the plain fields a pick file holds.

    :raise TypeError: a config that cannot be pinned (an IR override, or kwargs that are not JSON scalars).
    """
    if getattr(config, "ir_override", None) is not None:
        raise TypeError(f"config {config} has an ir_override, which a pick file cannot hold")
    kwargs = dict(config.kwargs)
    for name, value in kwargs.items():
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise TypeError(f"config {config} has {name}={value!r}, which a pick file cannot hold")
    return {"kwargs": kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def config_json(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if k != "maxnreg" or v is not None}


def sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def show_config(fields: dict) -> str:
    parts = [f"{k}={v}" for k, v in fields["kwargs"].items()]
    parts += [f"{k}={fields[k]}" for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if fields.get(k) is not None]
    return ", ".join(parts) or "(defaults)"


def _int(raw: dict, name: str, where: str, lo: int, default: Any = ...) -> Any:
    if name not in raw:
        if default is ...:
            raise PinFileError(f"{where}.{name}: missing")
        return default
    value = raw[name]
    if default is None and value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise PinFileError(f"{where}.{name}: expected an integer >= {lo}, got {json.dumps(value)}")
    return value


def parse_config(raw: Any, where: str) -> dict:
    """A config object of a pick file as ``config_fields`` gives it. :raise PinFileError: naming the field."""
    if not isinstance(raw, dict):
        raise PinFileError(f"{where}: expected an object, got {json.dumps(raw)}")
    unknown = sorted(set(raw) - {"kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg"})
    if unknown:
        raise PinFileError(f"{where}.{unknown[0]}: not a config field (kwargs, num_warps, num_stages, num_ctas, maxnreg)")
    kwargs = raw.get("kwargs")
    if not isinstance(kwargs, dict):
        raise PinFileError(f"{where}.kwargs: expected an object of meta-parameters, got {json.dumps(kwargs)}")
    for name, value in kwargs.items():
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise PinFileError(f"{where}.kwargs.{name}: expected a number, string, boolean or null, got {json.dumps(value)}")
    return {"kwargs": kwargs, "num_warps": _int(raw, "num_warps", where, 1), "num_stages": _int(raw, "num_stages", where, 0),
            "num_ctas": _int(raw, "num_ctas", where, 1, 1), "maxnreg": _int(raw, "maxnreg", where, 1, None)}


# --- the pick file


@dataclass(frozen=True)
class Pick:
    key: tuple
    encoded: list
    config: dict  # config_fields form


@dataclass
class PinFile:
    path: str
    gpu_name: str
    capability: tuple[int, int]
    triton: str
    exllamav3: str
    strict: bool
    kernels: dict[str, dict[str, Pick]]  # kernel -> key text -> pick

    @property
    def picks(self) -> int:
        return sum(len(v) for v in self.kernels.values())


def _require(doc: dict, name: str, kind: type, path: str) -> Any:
    value = doc.get(name)
    if not isinstance(value, kind):
        raise PinFileError(f"{path}: {name}: expected {'an object' if kind is dict else 'a string'}, got {json.dumps(value)}")
    return value


def parse(doc: Any, path: str) -> PinFile:
    """A pick file's JSON as a ``PinFile``. :raise PinFileError: naming ``path`` and the field."""
    if not isinstance(doc, dict):
        raise PinFileError(f"{path}: expected a JSON object")
    if doc.get("format") != FORMAT:
        raise PinFileError(f"{path}: format: expected {FORMAT!r}, got {json.dumps(doc.get('format'))}")
    if doc.get("version") != VERSION:
        raise PinFileError(f"{path}: version: this glm53 reads version {VERSION}, got {json.dumps(doc.get('version'))}")
    gpu = _require(doc, "gpu", dict, path)
    name = gpu.get("name")
    cap = gpu.get("capability")
    if not isinstance(name, str):
        raise PinFileError(f"{path}: gpu.name: expected a string, got {json.dumps(name)}")
    if not (isinstance(cap, list) and len(cap) == 2 and all(isinstance(c, int) and not isinstance(c, bool) for c in cap)):
        raise PinFileError(f"{path}: gpu.capability: expected [major, minor], got {json.dumps(cap)}")
    strict = doc.get("strict", False)
    if not isinstance(strict, bool):
        raise PinFileError(f"{path}: strict: expected true or false, got {json.dumps(strict)}")
    kernels: dict[str, dict[str, Pick]] = {}
    for kernel, entries in _require(doc, "kernels", dict, path).items():
        module, _, qualname = kernel.partition(":")
        if not module or not qualname:
            raise PinFileError(f"{path}: kernels[{kernel!r}]: a kernel is named 'module:function'")
        if not isinstance(entries, list):
            raise PinFileError(f"{path}: kernels[{kernel!r}]: expected a list of picks")
        picks = kernels[kernel] = {}
        for i, entry in enumerate(entries):
            where = f"{path}: kernels[{kernel!r}][{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("key"), list):
                raise PinFileError(f"{where}.key: expected a list (the autotune key)")
            key = tuple(decode_value(v, f"{where}.key[{j}]") for j, v in enumerate(entry["key"]))
            encoded = encode_key(key)
            pick = Pick(key, encoded, parse_config(entry.get("config"), f"{where}.config"))
            text = key_text(encoded)
            if text in picks and picks[text].config != pick.config:
                raise PinFileError(f"{where}: key {text} is pinned twice, to different configs")
            picks[text] = pick
    return PinFile(path, name, (cap[0], cap[1]), _require(doc, "triton", str, path), _require(doc, "exllamav3", str, path),
                   strict, kernels)


def load(path: str | os.PathLike) -> PinFile:
    """Read and check a pick file. :raise PinFileError: unreadable, not JSON, or a malformed field (named)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PinFileError(f"{path}: cannot read the pick file: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PinFileError(f"{path}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    return parse(doc, str(path))


def document(kernels: dict[str, list[dict]], *, gpu_name: str, capability: tuple[int, int], versions: dict,
             recorded: dict | None = None, strict: bool = False) -> dict:
    """A pick file's JSON. ``kernels``: {kernel: [{"key": encoded key, "config": config_json}]}."""
    doc = {"format": FORMAT, "version": VERSION, "gpu": {"name": gpu_name, "capability": list(capability)},
           "triton": versions.get("triton") or "unknown", "exllamav3": versions.get("exllamav3") or "unknown",
           "torch": versions.get("torch") or "unknown", "recorded": recorded or {}}
    if strict:
        doc["strict"] = True
    doc["kernels"] = {k: sorted(v, key=lambda e: key_text(e["key"])) for k, v in sorted(kernels.items()) if v}
    return doc


def dumps(doc: dict) -> str:
    """JSON with one pick per line, so that a changed pick is a one-line diff."""
    lines = ["{"]
    lines += [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}," for k, v in doc.items() if k != "kernels"]
    lines.append('  "kernels": {')
    kernels = list(doc["kernels"].items())
    for i, (kernel, entries) in enumerate(kernels):
        lines.append(f"    {json.dumps(kernel)}: [")
        lines += [f"      {json.dumps(e, sort_keys=True)}{',' if j < len(entries) - 1 else ''}" for j, e in enumerate(entries)]
        lines.append("    ]" + ("," if i < len(kernels) - 1 else ""))
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def merge(base: PinFile, kernels: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """``kernels`` plus every pick of ``base`` it lacks; where both have a key, ``base`` wins."""
    out = {k: {key_text(e["key"]): e for e in v} for k, v in kernels.items()}
    for kernel, picks in base.kernels.items():
        entries = out.setdefault(kernel, {})
        for text, pick in picks.items():
            entries[text] = {"key": pick.encoded, "config": config_json(pick.config)}
    return {k: list(v.values()) for k, v in out.items()}
