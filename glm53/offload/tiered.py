"""The RAM tier in the running offload: before a layer's experts run, every expert it picked that is not in VRAM is
made readable where its table entry points (``home``), from the RAM tier's slots or read from disk into its window.

The expert cache's kernels keep an expert's table entry at its VRAM slot while it is resident and at ``home`` (its
host address) otherwise; with every expert in the host store, ``home`` never changes. With a RAM tier an expert's
host address is wherever the tier holds it now, and one the tier does not hold has none. The invariant this part
keeps: when a layer's experts run, each of its picks that is not in VRAM has ``home`` (and so its table entry) at a
block holding its bytes. The cache's admissions copy from ``home`` in the same step, after this part, so they read
valid bytes too. An expert whose ``home`` goes stale (its window block reused by the next layer, its policy slot
evicted) is not picked in that step, and is re-resolved here the next time it is picked. That includes an expert VRAM
holds whose policy slot the tier gives up (``TierPolicy.exclusive``): it is not missed, so the tier's step does not
read it; when the VRAM cache evicts it (in that step or later, never in a step that picks it) its table entry goes to
the stale ``home``, a block that now plays another role (a window entry, whose next read overwrites it), and at its
next pick this part finds it in no slot, reads it, and re-points ``home`` and the table before its layer runs
(``home`` is compared with the block that holds its bytes now, ``RamTier.address``).

The tier sees only what the host sees, so this part synchronises at each MoE layer's routing (its picks and the
layer's VRAM residency, two small copies): with a RAM tier, decode pays one host round trip a layer, and the disk
reads are on that path. The host's own work for the layer (the tier's policy, pointing ``home`` and the tables at the
blocks, the CPU tier's table with them) runs while the disk reads; only then does it wait for the bytes. Without a
RAM tier this part does not exist and nothing changes. It acts on every forward: a decode step's (``RamTier.step``:
the tier's policy decides admissions) and any other (``RamTier.fetch``: prefill's picks read into the window; the
tier's policy is not told, as the VRAM cache's is not).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .cache import ExpertCache, Policy, predicted_admissions
from .part import Part
from .prefetch import PrecisionGate, router_prediction
from .ram_tier import RamTier, missed


# The share of its guesses a layer's steps must use for it to go on reading ahead: a used guess saves what the disk
# read during the GPU's work (~1.8 MB on the test host's 1.2 GB/s disk, a whole expert on an NVMe drive), a dropped one
# costs its pieces in flight (at most 8 x 128 KiB), so below ~0.3 it loses on the slow disk.
AHEAD_MIN_PRECISION = 0.3


class TieredHome(Part):
    name = "ram_tier"

    def __init__(self, tier: RamTier, cache: ExpertCache, device: torch.device, max_picks: int, routers=None,
                 write_back: Policy | None = None):
        """:param max_picks: the most picks one routing call makes (rows x top_k of the largest forward).
        :param routers: per MoE layer its router (``prefetch.router_prediction``'s), to predict the next layer's picks
            for the tier's reads ahead (None, or a tier without ahead entries: none).
        :param write_back: the VRAM cache's policy, to write its evictions back into the tier (:meth:`write_back`,
            ``GLM53_RAM_TIER_WRITE_BACK``); None: off."""
        self.tier, self.cache, self.device = tier, cache, device
        self.write_back_policy = write_back
        E = cache.store.num_experts
        self.routers = routers if tier.plan.ahead_slots else None
        # a layer whose guesses its steps use too rarely stops guessing for a while: a dropped guess's pieces in flight
        # still take the disk (bench.ram_tier_sim --read-ahead: precision 0.55 at one guess on the `trained` twin, 0.01
        # on `random`)
        self.gate = PrecisionGate(tier.store.num_layers, AHEAD_MIN_PRECISION) if self.routers is not None else None
        # called as ``(row, experts, addresses)`` after each re-pointing of ``home``: fast mode's CPU tier, whose
        # worker reads the same bytes at their host addresses (``FastTier.repoint``)
        self.on_rehome: list = []
        pinned = torch.cuda.is_available()  # the read-back buffers (a CPU test drives ``resolve`` alone)
        self._picks = torch.empty(max_picks, dtype=torch.int64, pin_memory=pinned)
        self._vram = torch.empty(E, dtype=torch.int32, pin_memory=pinned)
        self._guess = torch.empty(E, dtype=torch.int64, pin_memory=pinned)  # the next layer's, likeliest first
        self._vram_next = torch.empty(E, dtype=torch.int32, pin_memory=pinned)
        # the layer's VRAM policy state, for the write-back's prediction of the cache's step: freq, recent, prev, reuse
        shapes = ((E, torch.float32), (E, torch.float32), (E, torch.uint8), (2, torch.float32))
        self._state = None if write_back is None else tuple(torch.empty(n, dtype=t, pin_memory=pinned) for n, t in shapes)
        # seconds on the host: waiting for the routing (the sync), the tier's step or fetch, re-pointing the tables;
        # decode_*: the decode layers' share (what a token's time is made of, beside the GPU's)
        self.counters = {"decode_layers": 0, "other_layers": 0, "rewritten": 0, "wait_seconds": 0.0, "tier_seconds": 0.0,
                         "rehome_seconds": 0.0, "decode_wait_seconds": 0.0, "decode_tier_seconds": 0.0, "written_back": 0,
                         "predicted_evictions": 0}

    def place(self, row: int, selected: torch.Tensor, decode: bool, z: torch.Tensor | None = None) -> None:
        """After layer ``row``'s routing picked ``selected`` (int64 [rows, top_k]) from the router input ``z``, before
        its experts and the cache's step: each picked expert not in VRAM is made readable at its ``home``; then, in a
        one-stream decode step with reads ahead on, the next layer's likeliest experts (its router on ``z``) that
        neither VRAM nor a policy slot holds are read ahead (``RamTier.read_ahead``).

        :raise DiskReadError: a read failed; the layer does not run (the step fails), nothing was served from it.
        """
        flat = selected.reshape(-1)
        n = flat.numel()
        if n > self._picks.numel():
            self._picks = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self._picks[:n].copy_(flat, non_blocking=True)
        self._vram.copy_(self.cache.slot_of[row], non_blocking=True)
        ahead = (self.routers is not None and decode and z is not None and selected.shape[0] == 1
                 and row + 1 < len(self.routers))
        k = selected.shape[-1]  # as many as the layer picks
        if ahead:  # in the same sync: the next layer's guess and residency (its cache does not change before its routing)
            self._guess[:k].copy_(router_prediction(self.routers[row + 1], z, k).indices.reshape(-1), non_blocking=True)
            self._vram_next.copy_(self.cache.slot_of[row + 1], non_blocking=True)
        back = self.write_back_policy is not None and decode
        if back:  # in the same sync: what the cache's step of this layer decides from
            for buffer, source in zip(self._state, (self.cache.freq, self.cache.recent, self.cache.prev, self.cache.reuse)):
                buffer.copy_(source[row], non_blocking=True)
        t0 = time.perf_counter()
        torch.cuda.current_stream(self.device).synchronize()  # the picks are known on the host only now
        t1 = time.perf_counter()
        self.resolve(row, self._picks[:n].numpy().reshape(selected.shape), self._vram.numpy(), decode,
                     tuple(b.numpy() for b in self._state) if back else None)
        if ahead:
            self.guess(row + 1, self._guess[:k].numpy(), self._vram_next.numpy())
        t2 = time.perf_counter()
        self.counters["wait_seconds"] += t1 - t0
        self.counters["tier_seconds"] += t2 - t1
        if decode:
            self.counters["decode_wait_seconds"] += t1 - t0
            self.counters["decode_tier_seconds"] += t2 - t1

    def resolve(self, row: int, picks: np.ndarray, vram: np.ndarray, decode: bool, vram_state: tuple | None = None) -> None:
        """The host's part of :meth:`place`: ``picks`` (int [rows, top_k], or any shape whose last axis is a row;
        repeats allowed) against ``vram`` (int32 [experts], the layer's VRAM slot of each expert, -1 if none); with
        ``vram_state`` (the layer's VRAM policy state: freq, recent, prev, reuse) in a decode step, the cache's
        evictions are written back (:meth:`write_back`)."""
        tier_picks = missed(picks, vram)  # the rows kept: the tier's policy measures reuse on the first
        experts = np.unique(tier_picks[tier_picks >= 0])

        def point_home() -> None:  # while the disk reads: every pick's block is decided, its bytes still landing
            if not experts.size:
                return
            where = np.array([self.tier.address(row, int(e)) for e in experts], dtype=np.int64)
            moved = where != self.cache.home_host[row, experts]
            if moved.any():
                self.rehome(row, experts[moved], where[moved])

        if decode:
            served = self.tier.step(row, tier_picks, vram, placed=point_home)
            if self.gate is not None and served.guessed:
                self.gate.observe(row, served.guessed, served.ahead_used)
            self.counters["decode_layers"] += 1
        else:
            self.tier.fetch(row, tier_picks, placed=point_home)
            self.counters["other_layers"] += 1
        if decode and vram_state is not None and self.write_back_policy is not None:
            self.write_back(row, picks, vram, vram_state, experts)

    def write_back(self, row: int, picks: np.ndarray, vram: np.ndarray, vram_state: tuple, busy: np.ndarray) -> None:
        """After the tier's step, before the VRAM cache's: the experts the cache's step will evict (its decisions
        predicted from ``vram_state`` by its own definition, ``cache.predicted_admissions``) that no policy slot
        holds are offered to the tier (``RamTier.write_back``; never a slot of ``busy``, the experts this step reads
        from the tier); each it takes is copied from its VRAM slot into its new block, on the stream ahead of the
        cache's step, and its ``home`` points there (its table stays at its VRAM slot: the cache's step points it
        home when it evicts it). No disk read brings it back then.

        A prediction the device does not follow costs a copy and leaves a duplicate (the expert stays in VRAM too,
        its ``home`` a block with its bytes); the bytes copied are those of the expert the VRAM slot holds when the
        copy runs (``vram``, read at this sync), whatever the step then decides, so nothing is served wrong."""
        admissions = predicted_admissions(self.write_back_policy, picks, *vram_state[:3], vram_state[3], vram)
        if not admissions:
            return
        self.counters["predicted_evictions"] += len(admissions)
        held = vram >= 0
        for a in admissions:
            held[a.expert], held[a.evicted] = True, False
        placed = self.tier.write_back(row, [a.evicted for a in admissions], held, busy)
        if not placed:
            return
        experts = np.array([e for e, _ in placed], dtype=np.int64)
        for e, block in placed:
            self.cache.copy_out(int(vram[e]), self.tier.host_block(block))
        self.rehome(row, experts, self.tier.block_address([block for _, block in placed]), resident=True)
        self.counters["written_back"] += len(placed)

    def guess(self, row: int, likeliest: np.ndarray, vram: np.ndarray) -> None:
        """Read ahead the experts of layer ``row`` among ``likeliest`` (ids, best first) that ``vram`` (its VRAM slot
        of each expert, -1 if none) does not hold (the tier skips those in its policy slots)."""
        if self.gate is None or self.gate.allows(row):
            self.tier.read_ahead(row, [int(e) for e in likeliest if vram[int(e)] < 0])

    def decode_start(self, rows: int) -> None:
        if self.gate is not None:
            self.gate.forward_start()

    def rehome(self, row: int, experts: np.ndarray, addresses: np.ndarray, resident: bool = False) -> None:
        """Point non-resident ``experts`` of layer ``row`` (and their table entries) at ``addresses``; ``resident``:
        experts the VRAM cache holds, whose table entries stay at their slots (their ``home`` alone moves)."""
        t0 = time.perf_counter()
        addresses = np.asarray(addresses, dtype=np.int64)
        self.cache.home_host[row, experts] = addresses
        index = torch.from_numpy(experts.astype(np.int64)).to(self.device)
        self.cache.home[row].index_copy_(0, index, torch.from_numpy(addresses).to(self.device))
        if not resident:
            self.cache.assign([(row, int(e), -1) for e in experts])  # tables at home, from the device's home
        for listener in self.on_rehome:
            listener(row, experts, addresses)
        self.counters["rewritten"] += int(experts.size)
        self.counters["rehome_seconds"] += time.perf_counter() - t0

    def stats(self) -> dict:
        gate = {} if self.gate is None else {"ahead_gate": self.gate.stats()}
        return {**self.tier.stats(), "layers": dict(self.counters), **gate}

    def close(self) -> None:
        torch.cuda.synchronize(self.device)  # no kernel still reads the arena
        self.tier.reader.close()
        self.tier.unpin()
