"""Pinned Triton autotune picks: prefill numerics that are the same in every process.

exllamav3's KDA prefill kernels (vendored from flash-linear-attention in ``exllamav3.vendor.fla``) are
``triton.autotune`` kernels. Which of a kernel's configs wins is decided by timing, and the configs round
differently, so two processes could compute different prefill logits from the same tokens. A pick file
(``GLM53_TRITON_PIN``, written by ``glm53 triton-pin record``) names, per kernel and autotune key, the config to
use. After ``install``, every lookup of a key in the file answers with that config: the process never benchmarks
it and compiles only the pinned config.

A key that is not in the file is tuned by Triton as usual (by timing, or from Triton's own on-disk autotune
cache), counted in the report (``unpinned``) and logged once with its kernel and key, so a run can be checked to
have used pins only. With ``strict`` (the ``install`` argument, or ``"strict": true`` in the file) such a key
raises ``UnpinnedKey`` instead, in the launch that met it.

The pick file's format is in ``triton_pin_file``.

Patch points (Triton 3.6, exllamav3 1.6.5, ``patches.EXLLAMAV3_VERSION``: ``install`` refuses another exllamav3,
and checks them on every pinned kernel, so a change fails at start):

- ``triton.runtime.autotuner.Autotuner.run`` is wrapped at class level. Before a launch it replaces the instance's
  ``cache`` (Triton's ``{key tuple: Config}``, read as ``key not in self.cache`` then ``self.cache[key]``) with a
  ``PinnedCache``. Triton builds the key (the values of the ``key`` arguments, then ``str(dtype)`` of every
  argument with a dtype); it is never rebuilt here.
- ``Autotuner.configs`` (a pin must equal one of the declared configs, and that declared object is used),
  ``Autotuner.base_fn`` (its ``__module__``/``__qualname__`` name the kernel), ``Config`` fields ``kwargs``,
  ``num_warps``, ``num_stages``, ``num_ctas``, ``maxnreg``, ``ir_override``.
- exllamav3's ``vendor.fla.utils.DeviceAutotune`` (reached through ``.fn`` from the module attribute) makes one
  ``Autotuner`` per device kind on first launch; ``install`` calls its ``_tuner((), {})`` to make the current
  device's now, so pinned configs are checked at start, and attaches to every one in ``_tuners``.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from .patches import EXLLAMAV3_VERSION, InternalsChanged
from .triton_pin_file import (
    ArchitectureMismatch,
    PinFile,
    PinFileError,
    VersionMismatch,
    config_fields,
    config_json,
    encode_key,
    key_text,
    load,
    show_config,
    sm,
)

log = logging.getLogger(__name__)

# Heuristics -> DeviceAutotune -> Autotuner -> JITFunction: how far to follow ``.fn`` from a module attribute
_MAX_WRAPPERS = 5


class UnpinnedKey(RuntimeError):
    """Strict mode: a kernel met an autotune key that the pick file does not have."""


@dataclass
class PinReport:
    """What the pins did in this process (live: it keeps counting after ``install`` returns)."""

    file: str | None
    strict: bool
    loaded: int = 0  # picks in the file
    kernels: int = 0  # kernels in the file
    pinned: int = 0  # distinct (kernel, key) answered from the file
    unpinned_keys: list[dict] = field(default_factory=list)  # {"kernel", "key"} tuned by Triton itself

    @property
    def unpinned(self) -> int:
        return len(self.unpinned_keys)

    def as_dict(self) -> dict:
        return {"file": self.file, "strict": self.strict, "loaded": self.loaded, "kernels": self.kernels,
                "pinned": self.pinned, "unpinned": self.unpinned, "unpinned_keys": list(self.unpinned_keys)}


class _State:
    def __init__(self, pins: PinFile | None, strict: bool):
        self.pins = pins
        self.strict = strict
        self.report = PinReport(pins.path if pins else None, strict, pins.picks if pins else 0, len(pins.kernels) if pins else 0)
        self.lock = threading.Lock()
        self.tuners: weakref.WeakSet = weakref.WeakSet()  # every Autotuner attached (for collect and uninstall)

    def resolve(self, cache: PinnedCache, key: tuple) -> bool:
        """First lookup of ``key`` in ``cache``: seed it from the pins, or count it and let Triton tune it."""
        try:
            encoded = encode_key(key)
        except TypeError:
            encoded = None
        config = cache.picks.get(key_text(encoded)) if encoded is not None else None
        with self.lock:
            if config is not None:
                dict.__setitem__(cache, key, config)
                self.report.pinned += 1
                return True
            shown = encoded if encoded is not None else repr(key)
            if self.strict:
                raise UnpinnedKey(f"Triton kernel {cache.kernel}: autotune key {json.dumps(shown)} is not in the pick file {self.report.file} (strict)")
            self.report.unpinned_keys.append({"kernel": cache.kernel, "key": shown})
        if self.pins is not None:
            log.warning("Triton kernel %s: autotune key %s is not in the pick file %s; Triton picks its config by timing, "
                        "so prefill numerics may differ from other processes", cache.kernel, json.dumps(shown), self.report.file)
        return False


class PinnedCache(dict):
    """An Autotuner's ``cache`` whose first lookup of a key answers from the pick file (see ``_State.resolve``)."""

    def __init__(self, kernel: str, picks: dict, state: _State):
        super().__init__()
        self.kernel = kernel
        self.picks = picks  # key text -> the kernel's own declared Config
        self.state = state

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or self.state.resolve(self, key)


_state: _State | None = None
_patched: tuple[type, Any] | None = None  # (Autotuner class, its original run)


def kernel_name(tuner) -> str:
    fn = tuner.base_fn
    return f"{fn.__module__}:{fn.__qualname__}"


def _pick_map(tuner, state: _State) -> dict:
    """Key text -> the declared Config equal to the pin. :raise PinFileError: a pin that is not a declared config."""
    kernel = kernel_name(tuner)
    picks = state.pins.kernels.get(kernel, {}) if state.pins else {}
    declared = list(tuner.configs)
    fields = []
    for c in declared:
        try:
            fields.append(config_fields(c))
        except TypeError:
            fields.append(None)
    out = {}
    for text, pick in picks.items():
        match = next((c for c, f in zip(declared, fields) if f == pick.config), None)
        if match is None:
            raise PinFileError(f"{state.pins.path}: kernels[{kernel!r}]: the pinned config {show_config(pick.config)} (key {text}) "
                               f"is not one of the kernel's {len(declared)} declared configs; record the pick file again "
                               "for this exllamav3 and GPU")
        out[text] = match
    return out


def _attach(tuner, state: _State, picks: dict | None = None) -> None:
    tuner.cache = PinnedCache(kernel_name(tuner), _pick_map(tuner, state) if picks is None else picks, state)
    state.tuners.add(tuner)


def _with_pins(run):
    """``Autotuner.run`` that first gives the instance a ``PinnedCache`` of the installed pins."""

    @functools.wraps(run)
    def run_with_pins(self, *args, **kwargs):
        state = _state
        if state is not None:
            cache = self.cache
            if type(cache) is not PinnedCache or cache.state is not state:
                _attach(self, state)
        return run(self, *args, **kwargs)

    return run_with_pins


def _autotuner_class() -> type:
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError as exc:
        raise RuntimeError(f"pinned Triton picks need Triton, which cannot be imported here: {exc}") from None
    return Autotuner


def _visible_gpus() -> list[tuple[int, str, tuple[int, int]]]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [(i, torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i))) for i in range(torch.cuda.device_count())]


def runtime_versions() -> dict:
    versions = {}
    for name, module, attr in (("triton", "triton", "__version__"), ("exllamav3", "exllamav3.version", "__version__"),
                               ("torch", "torch", "__version__")):
        try:
            versions[name] = getattr(importlib.import_module(module), attr)
        except ImportError:
            versions[name] = None
    return versions


def check_gpus(pins: PinFile, gpus: list[tuple[int, str, tuple[int, int]]]) -> None:
    """:raise ArchitectureMismatch: no GPU, or one of another compute capability than the file's."""
    if not gpus:
        raise ArchitectureMismatch(f"{pins.path}: pins are for a CUDA GPU ({pins.gpu_name}, {sm(pins.capability)}); this process sees none")
    for index, name, capability in gpus:
        if tuple(capability) != pins.capability:
            raise ArchitectureMismatch(
                f"{pins.path} was recorded on {pins.gpu_name} ({sm(pins.capability)}), but cuda:{index} is {name} "
                f"({sm(capability)}); record a pick file on this GPU with `glm53 triton-pin record`")


def find_tuners(kernel: str, autotuner: type, path: str) -> list:
    """The Autotuner objects of ``kernel`` ('module:function'), made now where exllamav3 makes them lazily.

    :raise PinFileError: no such kernel. :raise InternalsChanged: it is not autotuned the way this module expects.
    """
    module_name, _, qualname = kernel.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PinFileError(f"{path}: kernels[{kernel!r}]: cannot import {module_name}: {exc}") from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        raise PinFileError(f"{path}: kernels[{kernel!r}]: {module_name} has no {qualname}; the pick file does not fit this exllamav3")
    tuners = []
    for _ in range(_MAX_WRAPPERS):
        if isinstance(obj, autotuner):
            tuners = [obj]
            break
        if callable(getattr(obj, "_tuner", None)) and isinstance(getattr(obj, "_tuners", None), dict):
            obj._tuner((), {})  # exllamav3's DeviceAutotune: the current device's Autotuner, made now
            tuners = [t for t in obj._tuners.values() if isinstance(t, autotuner)]
            break
        obj = getattr(obj, "fn", None)
        if obj is None:
            break
    if not tuners:
        raise InternalsChanged(f"{kernel} is not a triton.autotune kernel (nor exllamav3's DeviceAutotune of one); "
                               f"the pick file {path} cannot pin it")
    for t in tuners:
        if not (isinstance(getattr(t, "cache", None), dict) and hasattr(t, "configs") and hasattr(t, "base_fn")):
            raise InternalsChanged(f"Triton's Autotuner of {kernel} has no dict 'cache', 'configs' or 'base_fn'; the patch points moved")
        if kernel_name(t) != kernel:
            raise InternalsChanged(f"{kernel} resolves to the Autotuner of {kernel_name(t)}")
    return tuners


def install(path: str | os.PathLike | None, *, strict: bool | None = None) -> PinReport:
    """Pin the picks of the file at ``path``, for this process; call it before the model's first forward.

    Without a ``path`` nothing is pinned, but every Autotuner that runs is counted and kept for ``collect``
    (how ``glm53 triton-pin record`` works). Installing again replaces the pins and forgets earlier picks.

    :param strict: raise ``UnpinnedKey`` at a key the file lacks, instead of counting it; default: the file's
        ``strict`` field.
    :return: the live report: picks loaded, keys answered from the file, keys Triton tuned itself.
    :raise PinFileError: a malformed file, or one naming a kernel or config this exllamav3 does not have.
    :raise ArchitectureMismatch: the file was recorded on a GPU of another compute capability.
    :raise VersionMismatch: the file was recorded with another triton or exllamav3 than the running one.
    :raise InternalsChanged: the installed exllamav3 is not the one these patch points were written against, or
        Triton or exllamav3 changed the internals listed in the module docstring.
    """
    global _state, _patched
    autotuner = _autotuner_class()
    if not callable(getattr(autotuner, "run", None)):
        raise InternalsChanged("triton.runtime.autotuner.Autotuner has no run(); the patch points moved")
    running = runtime_versions()
    if running["exllamav3"] is not None and running["exllamav3"] != EXLLAMAV3_VERSION:
        raise InternalsChanged(f"glm53 pins Triton picks of exllamav3 {EXLLAMAV3_VERSION}'s kernels; exllamav3 "
                               f"{running['exllamav3']} is installed")
    pins = load(path) if path is not None else None
    if strict is None:
        strict = pins.strict if pins else False
    if strict and pins is None:
        raise ValueError("strict pinning needs a pick file")
    if pins is not None:
        check_gpus(pins, _visible_gpus())
        for name, recorded in (("triton", pins.triton), ("exllamav3", pins.exllamav3)):
            if running[name] is not None and running[name] != recorded:
                raise VersionMismatch(f"{pins.path} was recorded with {name} {recorded}, but {name} {running[name]} is "
                                      "running; record a pick file with this build (`glm53 triton-pin record`)")
    state = _State(pins, strict)
    # check every pin before changing anything
    attach = [(t, _pick_map(t, state)) for kernel in (pins.kernels if pins else {}) for t in find_tuners(kernel, autotuner, pins.path)]
    uninstall()
    _patched = (autotuner, autotuner.run)
    autotuner.run = _with_pins(autotuner.run)
    _state = state
    for tuner, picks in attach:
        _attach(tuner, state, picks)
    if pins is not None:
        log.info("Triton pins: %d picks for %d kernels from %s%s", pins.picks, len(pins.kernels), pins.path, " (strict)" if strict else "")
    return state.report


def uninstall() -> None:
    """Undo ``install``: Triton's own ``run`` again, and empty caches on the Autotuners that had pins."""
    global _state, _patched
    if _state is not None:
        for tuner in list(_state.tuners):
            tuner.cache = {}
    if _patched is not None:
        _patched[0].run = _patched[1]
    _state, _patched = None, None


def report() -> PinReport | None:
    return _state.report if _state is not None else None


def collect() -> dict[str, list[dict]]:
    """Every pick made since ``install``, pinned or tuned: {kernel: [{"key", "config"}]} for a pick file.

    :raise ValueError: a key or config that a pick file cannot hold (named with its kernel).
    """
    if _state is None:
        raise RuntimeError("nothing to collect: install() was not called")
    out: dict[str, dict[str, dict]] = {}
    for tuner in list(_state.tuners):
        kernel = kernel_name(tuner)
        entries = out.setdefault(kernel, {})
        for key, config in list(tuner.cache.items()):
            try:
                encoded, fields = encode_key(key), config_fields(config)
            except TypeError as exc:
                raise ValueError(f"Triton kernel {kernel}: {exc}") from None
            text = key_text(encoded)
            if text in entries and entries[text]["config"] != config_json(fields):
                log.warning("Triton kernel %s: key %s has two picks (one Autotuner per device kind); keeping the first", kernel, text)
                continue
            entries[text] = {"key": encoded, "config": config_json(fields)}
    return {k: list(v.values()) for k, v in out.items() if v}
