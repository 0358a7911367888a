"""Prefill staging: the next layer's non-resident experts are copied into VRAM one layer ahead, by DMA on a
copy stream, while the current layer computes.

A large forward reads every expert of every layer (2048 tokens x 8 picks touch all 288 experts), so a miss is
not a rare event as in decode: zero-copy reads would put PCIe on the critical path of every layer. Two staging
buffers alternate between layers; while layer ``i`` computes from buffer ``i % 2``, the copy engine fills the
other with layer ``i + 1``'s experts. Residency does not change during prefill (admission is a decode-only
decision), so which experts to stage is known on the host at the start of the forward (one synchronisation per
prefill forward, none per layer). Experts that do not fit in a buffer are read zero-copy (counted as overflow).
Table entries of staged experts point into the buffer only while their layer runs, then back home.

Beside a RAM tier (``tiered``) the sources are the tier's arena: a policy slot where one holds the expert, else its
window block, which a :class:`~glm53.offload.tier_feed.TierFeed` reads from disk a layer ahead. The experts read from
disk are staged first (the window is overwritten by the next layer, so they cannot be read zero-copy later), those
in policy slots with the room left, and the overflow is read zero-copy from its policy slot; a forward whose disk
reads do not fit in a buffer is not staged (each layer then reads at its routing, ``tiered.TieredHome``). The copy
of layer ``i + 1`` is queued after layer ``i``'s experts (not two layers ahead): it waits for the disk, and the
host should not stop queuing layer ``i``'s work for it.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import numpy as np
import torch

from .cache import ExpertCache
from .host_store import HostStore
from .ram_tier import RamTier
from .tier_feed import TierFeed
from .tiered import TieredHome

log = logging.getLogger(__name__)


class LayerStaging(NamedTuple):
    """One layer's part of a staged forward (expert ids, int64)."""

    missing: np.ndarray   # every expert VRAM does not hold
    staged: np.ndarray    # those copied into the layer's buffer, in buffer order
    sources: np.ndarray   # the block each is copied from: in the host store's layer arena, or in the RAM tier's arena
    overflow: np.ndarray  # those read zero-copy (from the host store, or from a policy slot of the RAM tier)
    disk: np.ndarray      # beside the RAM tier: those read from disk into its window first (staged, never overflow)
    homes: np.ndarray     # beside the RAM tier: each missing expert's host address for this forward (else empty)


def layer_staging(resident: np.ndarray, capacity: int, tier: RamTier | None = None) -> list[LayerStaging] | None:
    """What a forward stages, given ``resident`` (int32 [layers, experts], each expert's VRAM slot or -1) and a
    buffer of ``capacity`` experts: the missing experts in id order up to the capacity; beside ``tier``, its disk
    reads first, then policy-slot experts with the room left. None when a layer's disk reads do not fit."""
    none = np.zeros(0, dtype=np.int64)
    rows = []
    for row in range(resident.shape[0]):
        missing = np.flatnonzero(resident[row] < 0)
        if tier is None:
            staged = missing[:capacity]
            rows.append(LayerStaging(missing, staged, staged, missing[capacity:], none, none))
            continue
        held, blocks = tier.prefill_blocks(row, missing)
        disk, ram = missing[~held], missing[held]
        if len(disk) > capacity:
            return None
        room = capacity - len(disk)
        rows.append(LayerStaging(missing, np.concatenate([disk, ram[:room]]), np.concatenate([blocks[~held], blocks[held][:room]]),
                                 ram[room:], disk, tier.block_address(blocks)))
    return rows


class PrefillStager:
    def __init__(self, store: HostStore, cache: ExpertCache, tables, device: torch.device, buffer_bytes: int, min_rows: int,
                 tiered: TieredHome | None = None):
        """:param buffer_bytes: the most each of the two buffers may take (``ec_stage_gb``); ``begin`` is told
        how much VRAM the budget has left at that moment.
        :param tiered: the RAM tier's part, where the experts are on disk and in a RAM tier rather than the host store."""
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
        self.tiered = tiered
        self._arena = None if tiered is None else torch.from_numpy(tiered.tier.arena)  # the tier's pinned blocks
        self._feed: TierFeed | None = None
        self._ahead = 2 if tiered is None else 1  # layers copied ahead of the one computing
        self._forward_start: torch.cuda.Event | None = None
        self._timing: list[tuple[str, torch.cuda.Event, torch.cuda.Event, int]] = []  # (what, start, end, bytes)
        self.counters = {"dma_seconds": 0.0, "dma_bytes": 0, "compute_wait_seconds": 0.0, "forward_seconds": 0.0, "no_room": 0, "alloc_failures": 0, "forwards": 0, "layers": 0, "staged_experts": 0, "staged_bytes": 0, "overflow_experts": 0,
                         "tier_unstaged_forwards": 0, "disk_experts": 0, "disk_read_seconds": 0.0, "disk_wait_seconds": 0.0}

    @property
    def enabled(self) -> bool:
        return self.max_capacity > 0

    def wanted_bytes(self) -> int:
        """VRAM the two buffers take at full size (nothing more when they are already allocated)."""
        return 0 if self.buffers else 2 * self.max_capacity * self.block

    @property
    def active(self) -> bool:
        return self._plan is not None

    @property
    def feeding(self) -> bool:
        """A staged forward beside the RAM tier: every expert its layers read is staged or in a policy slot, so the
        tier's part has nothing to do at their routing."""
        return self._feed is not None and self._plan is not None

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
        self._end_feed()  # a forward that stopped before its last layer left one running
        resident = self.cache.resident()  # the one synchronisation of this forward
        rows = self._rows(resident)
        if rows is None:
            self.counters["tier_unstaged_forwards"] += 1
            return
        offs = np.array(self.store.layout.offsets, dtype=np.int64)
        to_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=False)
        plan = []
        for row, r in enumerate(rows):
            base = self.buffers[row % 2].data_ptr() + np.arange(len(r.staged), dtype=np.int64) * self.block
            plan.append({
                "experts": r.staged,
                "sources": r.sources,
                "index": to_dev(r.staged.astype(np.int64)),
                "staged": to_dev(base[:, None] + offs[None, :]),  # [n, 3] gate, up, down addresses
                "home": to_dev(self.cache.home_host[row, r.staged][:, None] + offs[None, :]),
            })
            self.counters["overflow_experts"] += len(r.overflow)
        self._plan = plan
        self.counters["forwards"] += 1
        if self._forward_start is None:
            self._forward_start = self._event(torch.cuda.current_stream(self.device))
        for row in range(min(self._ahead, self.store.num_layers)):
            self._copy(row)

    def _rows(self, resident: np.ndarray) -> list[LayerStaging] | None:
        """The forward's :func:`layer_staging`; beside the RAM tier it also points each expert's ``home`` where this
        forward reads it (the overflow's zero-copy reads, the tables between layers) and starts the disk reads' feed."""
        rows = layer_staging(resident, self.capacity, None if self.tiered is None else self.tiered.tier)
        if rows is None or self.tiered is None:
            return rows
        for row, r in enumerate(rows):
            moved = r.homes != self.cache.home_host[row, r.missing]
            if moved.any():
                self.tiered.rehome(row, r.missing[moved], r.homes[moved])
        self._feed = TierFeed(self.tiered.tier, [r.disk for r in rows])
        self.counters["disk_experts"] += sum(len(r.disk) for r in rows)
        return rows

    def _copy(self, row: int) -> None:
        """Queue the DMA of layer ``row``'s staged experts into buffer ``row % 2``, each run of adjacent source blocks
        one copy (adjacent experts are adjacent in the host store's arena; beside the RAM tier, the window's blocks
        are in expert order). Beside the tier it first waits for the feed's disk reads of the layer.

        :raise DiskReadError: the layer's disk reads failed (the forward fails here, before the layer runs).
        """
        p = self._plan[row]
        experts, sources = p["experts"], p["sources"]
        if self._feed is not None:
            t0 = time.perf_counter()
            self._feed.ready(row)
            self.counters["disk_wait_seconds"] += time.perf_counter() - t0
        src = self.store.arenas[row] if self._arena is None else self._arena
        buf = self.buffers[row % 2]
        stream = self.copy_stream
        stream.wait_event(self.free[row % 2])
        began = self._event(stream)
        with torch.cuda.stream(stream):
            start = 0
            while start < len(experts):
                end = start + 1
                while end < len(experts) and sources[end] == sources[end - 1] + 1:
                    end += 1
                b0, b1 = int(sources[start]), int(sources[end - 1]) + 1
                buf[start:end].view(-1).copy_(src[b0 * self.block : b1 * self.block], non_blocking=True)
                start = end
            self.cache.link.copied(len(experts) * self.block)
        self.ready[row % 2].record(stream)
        done = self._event(stream)
        self._timing.append(("dma", began, done, len(experts) * self.block))
        if self._feed is not None:
            self._feed.release(row, done)  # the window may take the next layer once these copies are done
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
        if row + self._ahead < self.store.num_layers:
            self._copy(row + self._ahead)
        if row == self.store.num_layers - 1:
            self._plan = None
            self._end_feed()

    def _end_feed(self) -> None:
        if self._feed is not None:
            self._feed.stop()
            self.counters["disk_read_seconds"] += self._feed.counters["read_seconds"]
            self._feed = None

    def release(self) -> None:
        """Give the buffers' VRAM back (after prefill, before decode takes the cache back). A prefill forward may
        stop before the last MoE layer (exllamav3 skips the layers after the last cache-writing one), so this
        also ends the plan."""
        self._plan = None
        self._end_feed()
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
