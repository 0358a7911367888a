"""Prefill's disk reads beside the RAM tier: each layer's experts that no policy slot holds are read into the tier's
window one layer ahead of the copies that stage them into VRAM, so that the disk works while the GPU computes.

A prefill forward picks nearly every expert of every layer, and which ones is known only at each layer's routing,
too late to read them without stalling the GPU. Prefill staging (``staging.PrefillStager``) therefore stages every
expert that VRAM does not hold, read or not: beside a RAM tier, those in its policy slots come straight from RAM,
the others from disk through the window, and this feed does the disk part on a thread of its own. The window holds
one layer, so the feed reads layer ``r + 1`` only once the copies of layer ``r`` out of it are done (the stager
hands it that copy stream's event); the GPU meanwhile computes from the staging buffers. A forward is then as long
as the longer of its disk reads and its compute, where reading at each layer's routing made it their sum.

The reads are speculative only in what a layer did not pick: a forward of ``STAGE_MIN_ROWS`` rows or more picks
nearly all of a layer's experts (2048 picks of 288 experts leave few out), and each read is one the routing would
have asked for at its layer. A read that fails fails the forward at the layer it was for: :meth:`TierFeed.ready`
raises it, and the window holds none of that layer's experts (``RamTier.fetch``'s contract).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Protocol

import numpy as np

from .disk import DiskReadError
from .ram_tier import RamTier


class Waitable(Protocol):
    def synchronize(self) -> None: ...  # a CUDA event: returns once the work recorded before it is done


class TierFeed:
    """Reads ``disk[row]`` (expert ids of each MoE layer, in layer order) into ``tier``'s window, one layer at a time.

    The caller owns the tier while the feed runs: between :meth:`ready` for a row and :meth:`release` of that row it
    may read the window (``RamTier.slot_index``), and it must not call the tier otherwise until :meth:`stop`.
    """

    def __init__(self, tier: RamTier, disk: list[np.ndarray]):
        self.tier, self.disk = tier, disk
        self._done = [threading.Event() for _ in disk]
        self._released: queue.Queue[Waitable | None] = queue.Queue()
        self._error: tuple[int, DiskReadError] | None = None
        self._stopping = False
        self.counters = {"layers": 0, "experts": 0, "read_seconds": 0.0, "wait_seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name="glm53-tier-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for row, experts in enumerate(self.disk):
            if row:
                done = self._released.get()  # the copies of the previous layer out of the window
                if done is None:
                    return
                done.synchronize()
            if self._stopping:
                return
            t0 = time.perf_counter()
            try:
                served = self.tier.fetch(row, experts)
            except DiskReadError as e:
                self._error = (row, e)
                for later in self._done[row:]:  # no later layer is read: each of them fails as well
                    later.set()
                return
            self.counters["read_seconds"] += time.perf_counter() - t0
            self.counters["layers"] += 1
            self.counters["experts"] += len(served.disk)
            self._done[row].set()

    def ready(self, row: int) -> None:
        """Wait until the window holds ``disk[row]``'s experts.

        :raise DiskReadError: reading them failed (the forward must fail: the window does not hold them).
        """
        t0 = time.perf_counter()
        self._done[row].wait()
        self.counters["wait_seconds"] += time.perf_counter() - t0
        if self._error is not None and self._error[0] <= row:
            raise self._error[1]

    def release(self, row: int, done: Waitable) -> None:
        """The window's blocks of ``row`` are copied once ``done`` is: the next layer may be read over them then."""
        if row + 1 < len(self.disk):
            self._released.put(done)

    def stop(self) -> None:
        """End the feed (a forward that ended, or stopped before its last layer) and wait for its thread: afterwards
        the window holds the last layer it read in full, or nothing (the tier's own bookkeeping says which)."""
        self._stopping = True
        self._released.put(None)
        self._thread.join()
