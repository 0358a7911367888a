"""ctypes binding of the expert cache's CUDA kernels (``native/ec/expert_cache.cu``), in the project's CUDA library
(``glm53.native.cuda`` finds, builds and loads it). Every call takes the torch stream it runs on. The mirror of
``struct EcState`` and the limits below are checked against the loaded library itself (``glm53.native.abi``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..native import abi, cuda

MAX_ADMIT = 16  # EC_MAX_ADMIT: admissions per layer and decode step the kernel can take
MAX_EXPERTS = 512  # EC_MAX_EXPERTS: experts per MoE layer (exllamav3's own limit)


class EcState(ctypes.Structure):
    """Mirror of ``struct EcState`` (the kernels read it by value)."""

    _fields_ = [
        ("num_layers", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("freq", ctypes.c_void_p),
        ("slot_of", ctypes.c_void_p),
        ("owner", ctypes.c_void_p),
        ("picks", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("home", ctypes.c_void_p),
        ("slot_addr", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("off_up", ctypes.c_int64),
        ("off_down", ctypes.c_int64),
        ("jobs", ctypes.c_void_p),
        ("num_jobs", ctypes.c_void_p),
    ]


class EcRecency(ctypes.Structure):
    """Mirror of ``struct EcRecency``: the fast score's state and settings (``cache_policy.Recency``), by value."""

    _fields_ = [
        ("recent", ctypes.c_void_p),
        ("prev", ctypes.c_void_p),
        ("reuse", ctypes.c_void_p),
        ("decay", ctypes.c_float),
        ("weight", ctypes.c_float),
        ("keep", ctypes.c_float),
    ]


class EcPool(ctypes.Structure):
    """Mirror of ``struct EcPool`` (``native/ec/prefetch.cuh``): the prefetch pool's VRAM slots and bookkeeping."""

    _fields_ = [
        ("slots", ctypes.c_int),
        ("slot_addr", ctypes.c_void_p),
        ("owner", ctypes.c_void_p),
        ("num", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
    ]


class LeLink(ctypes.Structure):
    """Mirror of ``struct LeLink`` (``native/ec/link_emulate.cuh``): a slower link's added time per byte, and where
    the emulation counts what it held."""

    _fields_ = [
        ("zero_copy_ns_per_byte", ctypes.c_double),
        ("copy_ns_per_byte", ctypes.c_double),
        ("counters", ctypes.c_void_p),
    ]


LINK_KINDS = ("misses", "fallback", "admissions", "prefetch", "tier_io", "copies", "probe")  # the emulation's counters, in order

PF_MAX_SLOTS = 16  # prefetch pool slots the kernels take
PF_MAX_PREDICTED = 64  # predicted experts per row
PF_COUNTERS = ("copied", "used", "wasted", "plans")  # per layer, in the kernels' order


class Kernels:
    """The loaded library."""

    def __init__(self, path: Path | None = None):
        """:raise NativeBuildError: no library found or built (``glm53.native.cuda.locate``). :raise AbiMismatch:
        the library's ``EcState`` or limits are not this module's (a stale build)."""
        lib, self.path = cuda.library(path)
        abi.check(lib.ec_abi, self.path, {"EcState": EcState, "EcRecency": EcRecency}, {"limit.max_admit": MAX_ADMIT, "limit.max_experts": MAX_EXPERTS})
        abi.check(lib.ec_prefetch_abi, self.path, {"EcPool": EcPool},
                  {"limit.max_slots": PF_MAX_SLOTS, "limit.max_predicted": PF_MAX_PREDICTED, "counter.count": len(PF_COUNTERS),
                   **{f"counter.{name}": i for i, name in enumerate(PF_COUNTERS)}})
        abi.check(lib.le_abi, self.path, {"LeLink": LeLink},
                  {"kind.count": len(LINK_KINDS), **{f"kind.{name}": i for i, name in enumerate(LINK_KINDS)}})
        p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        lib.ec_step.argtypes = [ctypes.POINTER(EcState), ctypes.POINTER(EcRecency), i, p, i, i, f, f, i, i64, i, p]
        lib.ec_assign.argtypes = [ctypes.POINTER(EcState), p, i, p]
        lib.ec_read_probe.argtypes = [p, i64, p, i, p]
        lib.ec_prefetch.argtypes = [ctypes.POINTER(EcState), ctypes.POINTER(EcPool), i, p, i, i, i, i64, i, p]
        lib.ec_prefetch_release.argtypes = [ctypes.POINTER(EcState), ctypes.POINTER(EcPool), i, p, i, p]
        link = ctypes.POINTER(LeLink)
        lib.le_picks.argtypes = [link, ctypes.POINTER(EcState), i, p, p, i, i64, i, i, p]
        lib.le_counts.argtypes = [link, ctypes.POINTER(EcState), i, p, i64, i, i, p]
        lib.le_units.argtypes = [link, p, i64, i64, i, i, i, p]
        lib.le_tier_io.argtypes = [link, p, p, i64, i64, i, p]
        for fn in (lib.ec_step, lib.ec_assign, lib.ec_read_probe, lib.ec_prefetch, lib.ec_prefetch_release, lib.le_picks,
                   lib.le_counts, lib.le_units, lib.le_tier_io):
            fn.restype = ctypes.c_int
        self._lib = lib

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what}: CUDA error {code}")

    def step(self, state: EcState, recency: EcRecency, layer: int, sel: torch.Tensor, decay: float, hysteresis: float, max_admit: int,
             block_bytes: int, copy_blocks: int) -> None:
        """sel: int64 [rows, top_k] (contiguous); the first row measures the reuse lift."""
        stream = torch.cuda.current_stream().cuda_stream
        row = sel.shape[-1] if sel.dim() else 1
        self._check(self._lib.ec_step(ctypes.byref(state), ctypes.byref(recency), layer, sel.data_ptr(), sel.numel(), row, decay,
                                      hysteresis, max_admit, block_bytes, copy_blocks, stream), "ec_step")

    def assign(self, state: EcState, entries: torch.Tensor) -> None:
        """entries: int32 [n, 3] (layer row, expert, slot or -1) on the device."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ec_assign(ctypes.byref(state), entries.data_ptr(), entries.shape[0], stream), "ec_assign")

    def read_probe(self, src: torch.Tensor, out: torch.Tensor, blocks: int) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ec_read_probe(src.data_ptr(), src.numel() * src.element_size(), out.data_ptr(), blocks, stream), "ec_read_probe")

    def prefetch(self, state: EcState, pool: EcPool, layer: int, predicted: torch.Tensor, max_copies: int, block_bytes: int,
                 copy_blocks: int) -> None:
        """Plan and copy layer ``layer``'s prefetch from ``predicted`` (int64 [rows, n]) on the current stream."""
        stream = torch.cuda.current_stream().cuda_stream
        rows, n = predicted.shape
        self._check(self._lib.ec_prefetch(ctypes.byref(state), ctypes.byref(pool), layer, predicted.data_ptr(), rows, n, max_copies,
                                          block_bytes, copy_blocks, stream), "ec_prefetch")

    def prefetch_release(self, state: EcState, pool: EcPool, layer: int, sel: torch.Tensor) -> None:
        """After layer ``layer``'s experts (its picks ``sel``), on the current stream: count, point home, free the pool."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ec_prefetch_release(ctypes.byref(state), ctypes.byref(pool), layer, sel.data_ptr(), sel.numel(), stream),
                    "ec_prefetch_release")

    # ---- the in-band link emulation (glm53.offload.link), on the current stream

    def link_picks(self, link: LeLink, state: EcState, layer: int, sel: torch.Tensor, rw: torch.Tensor | None, block_bytes: int,
                   kind: int, blocks: int) -> None:
        """Hold for the experts of ``layer`` among the picks ``sel`` (int64) that are read from the host store (``rw``:
        their fp16 weights, a pick of weight 0 unread; None: every pick read)."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.le_picks(ctypes.byref(link), ctypes.byref(state), layer, sel.data_ptr(), 0 if rw is None else rw.data_ptr(),
                                       sel.numel(), block_bytes, kind, blocks, stream), "le_picks")

    def link_counts(self, link: LeLink, state: EcState, layer: int, count: torch.Tensor, block_bytes: int, kind: int, blocks: int) -> None:
        """Hold for the experts of ``layer`` with picks in ``count`` (int64 [E + 1]) that are read from the host store."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.le_counts(ctypes.byref(link), ctypes.byref(state), layer, count.data_ptr(), block_bytes, kind, blocks, stream),
                    "le_counts")

    def link_units(self, link: LeLink, units: torch.Tensor | None, unit_bytes: int, fixed_bytes: int, copy_engine: bool, kind: int,
                   blocks: int) -> None:
        """Hold for ``fixed_bytes`` plus ``units`` (int32 [1] on the device, or None) times ``unit_bytes``."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.le_units(ctypes.byref(link), 0 if units is None else units.data_ptr(), unit_bytes, fixed_bytes,
                                       int(copy_engine), kind, blocks, stream), "le_units")

    def link_tier_io(self, link: LeLink, status: torch.Tensor, outcome: torch.Tensor, in_bytes: int, out_bytes: int) -> None:
        """Hold for a CPU-tier job's input rows (when it was published) and its partial (when it was delivered)."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.le_tier_io(ctypes.byref(link), status.data_ptr(), outcome.data_ptr(), in_bytes, out_bytes, 1, stream),
                    "le_tier_io")
