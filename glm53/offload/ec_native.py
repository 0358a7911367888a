"""The expert cache's CUDA kernels (``native/ec/expert_cache.cu``), in the project's CUDA library (``glm53.native.cuda``
finds, builds and loads it). Every call takes the torch stream it runs on. The structs, limits and signatures are
``glm53.native.cuda_binding``'s, generated from ``native/ec/expert_cache.h`` and checked against the loaded library;
an argument the library refuses raises ``NativeError`` with its own sentence naming the argument.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..native import abi, cuda
from ..native.cuda_binding import (EC_MAX_ADMIT, EC_MAX_EXPERTS, PF_MAX_PREDICTED, PF_MAX_SLOTS, EcPool, EcRecency,
                                   EcState, LeLink, le_kind, pf_counter)

MAX_ADMIT = EC_MAX_ADMIT  # admissions per layer and decode step the kernel can take
MAX_EXPERTS = EC_MAX_EXPERTS  # experts per MoE layer (exllamav3's own limit)
LINK_KINDS = abi.names(le_kind, "LE_", "LE_KINDS")  # the emulation's counters, in order: misses, fallback, admissions, ...
PF_COUNTERS = abi.names(pf_counter, "PF_", "PF_N")  # per layer, in the kernels' order: copied, used, wasted, plans
__all__ = [
    "LINK_KINDS",
    "MAX_ADMIT",
    "MAX_EXPERTS",
    "PF_COUNTERS",
    "PF_MAX_PREDICTED",
    "PF_MAX_SLOTS",
    "EcPool",
    "EcRecency",
    "EcState",
    "Kernels",
    "LeLink",
]


class Kernels:
    """The loaded library."""

    def __init__(self, path: Path | None = None):
        """:raise NativeBuildError: no library found or built (``glm53.native.cuda.locate``). :raise AbiMismatch:
        the library's structs, limits or functions are not the binding's (a stale build)."""
        self._lib, self.path = cuda.library(path)

    def _check(self, code: int) -> None:
        cuda.checked(self._lib, code)

    def step(self, state: EcState, recency: EcRecency, layer: int, sel: torch.Tensor, decay: float, hysteresis: float, max_admit: int,
             block_bytes: int, copy_blocks: int) -> None:
        """sel: int64 [rows, top_k] (contiguous); the first row measures the reuse lift."""
        stream = torch.cuda.current_stream().cuda_stream
        row = sel.shape[-1] if sel.dim() else 1
        self._check(self._lib.ec_step(ctypes.byref(state), ctypes.byref(recency), layer, sel.data_ptr(), sel.numel(), row, decay,
                                      hysteresis, max_admit, block_bytes, copy_blocks, stream))

    def assign(self, state: EcState, entries: torch.Tensor) -> None:
        """entries: int32 [n, 3] (layer row, expert, slot or -1) on the device."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ec_assign(ctypes.byref(state), entries.data_ptr(), entries.shape[0], stream))

    def read_probe(self, src: torch.Tensor, out: torch.Tensor, blocks: int) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ec_read_probe(src.data_ptr(), src.numel() * src.element_size(), out.data_ptr(), blocks, stream))

    def prefetch(self, state: EcState, pool: EcPool, layer: int, predicted: torch.Tensor, max_copies: int, block_bytes: int,
                 copy_blocks: int, scores: torch.Tensor | None = None, min_score: float = float("-inf")) -> None:
        """Plan and copy layer ``layer``'s prefetch from ``predicted`` (int64 [rows, n], contiguous) on the current
        stream: at most ``max_copies`` of the entries whose ``scores`` (float32 [rows, n], contiguous; None: every
        entry) are at least ``min_score``."""
        stream = torch.cuda.current_stream().cuda_stream
        rows, n = predicted.shape
        if scores is not None and (scores.dtype != torch.float32 or scores.shape != predicted.shape or not scores.is_contiguous()):
            raise ValueError(f"scores must be contiguous float32 {tuple(predicted.shape)}, not {scores.dtype} {tuple(scores.shape)}")
        self._check(self._lib.ec_prefetch(ctypes.byref(state), ctypes.byref(pool), layer, predicted.data_ptr(),
                                          None if scores is None else scores.data_ptr(), rows, n, min_score, max_copies,
                                          block_bytes, copy_blocks, stream))

    def prefetch_release(self, state: EcState, pool: EcPool, layer: int, sel: torch.Tensor) -> None:
        """After layer ``layer``'s experts (its picks ``sel``), on the current stream: count, point home, free the pool."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ec_prefetch_release(ctypes.byref(state), ctypes.byref(pool), layer, sel.data_ptr(), sel.numel(), stream))

    # ---- the in-band link emulation (glm53.offload.link), on the current stream

    def link_picks(self, link: LeLink, state: EcState, layer: int, sel: torch.Tensor, rw: torch.Tensor | None, block_bytes: int,
                   kind: int, blocks: int) -> None:
        """Hold for the experts of ``layer`` among the picks ``sel`` (int64) that are read from the host store (``rw``:
        their fp16 weights, a pick of weight 0 unread; None: every pick read)."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.le_picks(ctypes.byref(link), ctypes.byref(state), layer, sel.data_ptr(), 0 if rw is None else rw.data_ptr(),
                                       sel.numel(), block_bytes, kind, blocks, stream))

    def link_counts(self, link: LeLink, state: EcState, layer: int, count: torch.Tensor, block_bytes: int, kind: int, blocks: int) -> None:
        """Hold for the experts of ``layer`` with picks in ``count`` (int64 [E + 1]) that are read from the host store."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.le_counts(ctypes.byref(link), ctypes.byref(state), layer, count.data_ptr(), block_bytes, kind, blocks, stream))

    def link_units(self, link: LeLink, units: torch.Tensor | None, unit_bytes: int, fixed_bytes: int, copy_engine: bool, kind: int,
                   blocks: int) -> None:
        """Hold for ``fixed_bytes`` plus ``units`` (int32 [1] on the device, or None) times ``unit_bytes``."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.le_units(ctypes.byref(link), 0 if units is None else units.data_ptr(), unit_bytes, fixed_bytes,
                                       int(copy_engine), kind, blocks, stream))

    def link_tier_io(self, link: LeLink, status: torch.Tensor, outcome: torch.Tensor, in_bytes: int, out_bytes: int) -> None:
        """Hold for a CPU-tier job's input rows (when it was published) and its partial (when it was delivered)."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.le_tier_io(ctypes.byref(link), status.data_ptr(), outcome.data_ptr(), in_bytes, out_bytes, 1, stream))
