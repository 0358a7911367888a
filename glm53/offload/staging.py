"""Prefill staging: the next layer's non-resident experts are copied into VRAM one layer ahead, by DMA on a
copy stream, while the current layer computes.

A large forward reads every expert of every layer (2048 tokens x 8 picks touch all 288 experts), so a miss is
not a rare event as in decode: zero-copy reads would put PCIe on the critical path of every layer. Two staging
buffers alternate between layers; while layer ``i`` computes from buffer ``i % 2``, the copy engine fills the
other with layer ``i + 1``'s experts. Residency does not change during prefill (admission is a decode-only
decision), so which experts to stage is known on the host at the start of the forward (one synchronisation per
prefill forward, none per layer). Experts that do not fit in a buffer are read zero-copy (counted as overflow).
Table entries of staged experts point into the buffer only while their layer runs, then back home.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .cache import ExpertCache
from .host_store import HostStore

log = logging.getLogger(__name__)


class PrefillStager:
    def __init__(self, store: HostStore, cache: ExpertCache, tables, device: torch.device, buffer_bytes: int, min_rows: int):
        """:param buffer_bytes: the most each of the two buffers may take (``ec_stage_gb``); ``begin`` is told
        how much VRAM the budget has left at that moment."""
        self.store = store
        self.cache = cache
        self.tables = tables  # per layer: gate, up, down (E,), gate/up (E, 2)
        self.device = device
        self.block = store.layout.block_bytes
        self.max_capacity = max(0, buffer_bytes // self.block)  # experts per buffer
        self.capacity = 0
        self.min_rows = min_rows
        self.copy_stream = torch.cuda.Stream(device)
        self.buffers: list[torch.Tensor] = []
        self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        self.free = [torch.cuda.Event(), torch.cuda.Event()]
        self._plan: list[dict] | None = None
        self._forward_start: torch.cuda.Event | None = None
        self._timing: list[tuple[str, torch.cuda.Event, torch.cuda.Event, int]] = []  # (what, start, end, bytes)
        self.counters = {"dma_seconds": 0.0, "dma_bytes": 0, "compute_wait_seconds": 0.0, "forward_seconds": 0.0, "no_room": 0, "alloc_failures": 0, "forwards": 0, "layers": 0, "staged_experts": 0, "staged_bytes": 0, "overflow_experts": 0}

    @property
    def enabled(self) -> bool:
        return self.max_capacity > 0

    def wanted_bytes(self) -> int:
        """VRAM the two buffers take at full size (nothing more when they are already allocated)."""
        return 0 if self.buffers else 2 * self.max_capacity * self.block

    @property
    def active(self) -> bool:
        return self._plan is not None

    def begin(self, available_bytes: int) -> None:
        """Start of a large forward: allocate the buffers (within ``available_bytes`` for both), plan every
        layer, start copying layers 0 and 1."""
        if not self.buffers:
            self.capacity = min(self.max_capacity, available_bytes // 2 // self.block)
            if self.capacity == 0:
                self.counters["no_room"] += 1
                return
            try:
                self.buffers = self._allocate()
            except torch.OutOfMemoryError:
                # the budget said there was room but the allocator found none (fragmentation, another process):
                # this forward reads its misses zero-copy instead, slower but the same numbers
                self.buffers = []
                self.counters["alloc_failures"] += 1
                log.warning("prefill staging: could not allocate 2 x %.2f GB; this forward reads its experts zero-copy",
                            self.capacity * self.block / 1e9)
                return
        resident = self.cache.resident()  # the one synchronisation of this forward
        offs = np.array(self.store.layout.offsets, dtype=np.int64)
        home = self.cache.home_host
        plan = []
        for row in range(self.store.num_layers):
            missing = np.flatnonzero(resident[row] < 0)
            staged, overflow = missing[: self.capacity], missing[self.capacity :]
            base = self.buffers[row % 2].data_ptr() + np.arange(len(staged), dtype=np.int64) * self.block
            to_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=False)
            plan.append({
                "experts": staged,
                "index": to_dev(staged.astype(np.int64)),
                "staged": to_dev(base[:, None] + offs[None, :]),  # [n, 3] gate, up, down addresses
                "home": to_dev(home[row, staged][:, None] + offs[None, :]),
            })
            self.counters["overflow_experts"] += len(overflow)
        self._plan = plan
        self.counters["forwards"] += 1
        if self._forward_start is None:
            self._forward_start = self._event(torch.cuda.current_stream(self.device))
        for row in (0, 1):
            if row < self.store.num_layers:
                self._copy(row)

    def _copy(self, row: int) -> None:
        """Queue the DMA of layer ``row``'s staged experts into buffer ``row % 2`` (runs of adjacent experts are
        adjacent in the host arena, so each run is one copy)."""
        experts = self._plan[row]["experts"]
        buf = self.buffers[row % 2]
        stream = self.copy_stream
        stream.wait_event(self.free[row % 2])
        began = self._event(stream)
        with torch.cuda.stream(stream):
            start = 0
            while start < len(experts):
                end = start + 1
                while end < len(experts) and experts[end] == experts[end - 1] + 1:
                    end += 1
                e0, e1 = int(experts[start]), int(experts[end - 1]) + 1
                src = self.store.arenas[row][e0 * self.block : e1 * self.block]
                buf[start:end].view(-1).copy_(src, non_blocking=True)
                start = end
            self.cache.link.copied(len(experts) * self.block)
        self.ready[row % 2].record(stream)
        self._timing.append(("dma", began, self._event(stream), len(experts) * self.block))
        self.counters["staged_experts"] += len(experts)
        self.counters["staged_bytes"] += len(experts) * self.block

    def _point(self, row: int, which: str) -> None:
        p = self._plan[row]
        if not len(p["experts"]):
            return
        addr = p[which]
        g, u, d, gu = self.tables[row]
        g.index_copy_(0, p["index"], addr[:, 0])
        u.index_copy_(0, p["index"], addr[:, 1])
        d.index_copy_(0, p["index"], addr[:, 2])
        gu.index_copy_(0, p["index"], addr[:, :2])

    def before_layer(self, row: int) -> None:
        compute = torch.cuda.current_stream(self.device)
        before = self._event(compute)
        compute.wait_event(self.ready[row % 2])
        self._timing.append(("wait", before, self._event(compute), 0))
        self._point(row, "staged")
        self.counters["layers"] += 1

    def after_layer(self, row: int) -> None:
        self._point(row, "home")
        self.free[row % 2].record(torch.cuda.current_stream(self.device))
        if row + 2 < self.store.num_layers:
            self._copy(row + 2)
        if row == self.store.num_layers - 1:
            self._plan = None

    def release(self) -> None:
        """Give the buffers' VRAM back (after prefill, before decode takes the cache back). A prefill forward may
        stop before the last MoE layer (exllamav3 skips the layers after the last cache-writing one), so this
        also ends the plan."""
        self._plan = None
        if self.buffers:
            end = self._event(torch.cuda.current_stream(self.device))
            self.copy_stream.synchronize()
            end.synchronize()
            for what, a, b, nbytes in self._timing:
                if what == "dma":
                    self.counters["dma_seconds"] += a.elapsed_time(b) / 1000
                    self.counters["dma_bytes"] += nbytes
                else:
                    self.counters["compute_wait_seconds"] += a.elapsed_time(b) / 1000
            if self._forward_start is not None:
                self.counters["forward_seconds"] += self._forward_start.elapsed_time(end) / 1000
            self._timing.clear()
            self._forward_start = None
            self.buffers = []

    def _allocate(self) -> list[torch.Tensor]:
        return [torch.empty((self.capacity, self.block), dtype=torch.uint8, device=self.device) for _ in range(2)]

    @staticmethod
    def _event(stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def stats(self) -> dict:
        c = self.counters
        return {"buffer_experts_max": self.max_capacity, "buffer_experts": self.capacity, "buffer_bytes": self.capacity * self.block,
                "min_rows": self.min_rows, **c, "dma_gbs": round(c["dma_bytes"] / c["dma_seconds"] / 1e9, 2) if c["dma_seconds"] else None}
