"""The RAM tier: where host RAM cannot hold every routed expert, a budget of expert slots over the checkpoint's own
files, between the GPU expert cache and the disk.

With a budget that holds the host store (:func:`plan` gives None) nothing changes: the store reads every expert
once at start and the disk is not read again. Otherwise the tier's arena (pinned and mapped, so the GPU reads it in
place as it reads the host store) has three parts, each entry one expert block in the host store's
``[gate | up | down]`` layout (so that a VRAM admission stays one contiguous copy):

- **policy slots**, partitioned between the layers at start by the routing profile and replaced by the expert
  cache's own policy (``cache_policy.ReferenceCache``: one definition, here a second instance of it, over the picks
  the VRAM cache missed, with the tier's parameters, :class:`TierPolicy`). At start they hold the hottest experts
  after the ones the VRAM cache takes. The scores start at the profile's steady state, the VRAM residents' too
  (``vram_score``), so an expert the VRAM cache evicts reaches this tier with its popularity and takes a slot at its
  first miss. The fast score (recency) is on, weighted by the reuse the tier measures on its own misses above what
  popularity alone gives them: misses that recur over tokens (a trained router's) stay in RAM, and misses that do not
  are ranked by popularity alone, as the placement ranks them. The slots are exclusive of VRAM's, after a delay: the
  slot of an expert the VRAM cache has held for the layer's last ``exclusive_after`` decode steps is the first given
  up (a VRAM admission copies the expert from its RAM slot, which would otherwise duplicate it);
- **the window**, one entry per expert of a layer (entry ``e`` for expert ``e``): where a layer's step reads the
  experts it needs that no policy slot holds. A layer's forward can pick every expert (a prefill's does), so the
  window holds a whole layer; it is the current layer's only, and the next layer's step overwrites it (the engine
  synchronises at every layer's routing, so no kernel still reads it then).
- **the ahead entries** (``GLM53_RAM_TIER_READ_AHEAD``, none by default): where the next layer's likeliest experts
  (its router on this layer's input: ``tiered.TieredHome``) are read while this layer's experts and the next
  layer's attention run on the GPU, which the disk would otherwise sit out. The next layer's step takes the blocks of
  those it picked into their window entries and drops the rest's pieces not yet begun.

A decode step of a layer (:meth:`RamTier.step`, given the picks the VRAM cache missed): each missed expert not in a
policy slot is read from disk, and the policy's step decides the admissions (below: how the two overlap). Admission
costs no extra read (the bytes are read anyway), so ``max_admit`` is every miss, and the
hysteresis alone keeps one-off picks from evicting warmer experts. The tier's first policy (the VRAM cache's decay
and hysteresis, no recency, the VRAM residents' scores at zero) practically never replaced anything (2 admissions in
~100 decode steps on the H200); ``bench/ram_tier_sim.py`` replays both on traces against Belady's optimum
(bench/results/2026-12-02-ram-tier-policy.md). Any other forward (:meth:`RamTier.fetch`) reads
into the window only and leaves the policy alone, as the VRAM cache does.

Slots and window entries are roles, not places: ``RamTier.blocks`` maps each (policy slot ``s``, or window entry
``policy_slots + e``) to the arena block that plays it. A decode step reads every missed expert into its window
entry, submitted before the policy's step, which runs on the host while the disk works; an expert the policy admits
then takes its window entry's block into its slot, and the slot's old block becomes that window entry's, by
exchanging the two in the map: no byte is copied, and nothing is read into a slot after the start (but a guess read
ahead whose read failed, read again into the block its slot took). Every block is decided before the wait for the
reads, so the caller points its tables there while the disk still works (``step``'s ``placed``). A read that fails
fails the step (:class:`~glm53.offload.disk.DiskReadError`): the step's admissions and exchanges are undone, every
slot keeps its block and its bytes, and the expert it was for is in no slot, so nothing is served from a failed read.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .. import config
from .cache_policy import Admission, Recency, ReferenceCache, placement, popularity_lift, warm_scores
from .disk import Batch, DiskReader, DiskReadError, Read
from .host_store import HostStore


# The pieces of reads ahead: a wrong guess's pieces in flight when the next step drops it still take the disk, up to a
# piece a reader thread (8 x 128 KiB, ~1 ms at 1 GB/s); its own reads keep the reader's larger pieces.
AHEAD_PIECE_BYTES = 128 << 10


class RamBudgetError(ValueError):
    """A RAM budget below what one layer's step needs at once; the message says how much is needed."""


@dataclasses.dataclass(frozen=True)
class TierPlan:
    policy_slots: int
    window_slots: int  # one layer's experts
    block_bytes: int
    ahead_slots: int = 0  # the next layer's predicted experts read ahead (:meth:`RamTier.read_ahead`)

    @property
    def slots(self) -> int:
        return self.policy_slots + self.window_slots + self.ahead_slots

    @property
    def bytes(self) -> int:
        return self.slots * self.block_bytes


def plan(store: HostStore, budget_bytes: int, what: str = "the RAM budget", ahead: int = 0) -> TierPlan | None:
    """The tier a budget of host bytes for expert blocks gives, or None when it holds the whole host store.

    :param what: how the budget was set, for the message (``GLM53_HOST_RAM_GB=40``).
    :param ahead: blocks for the next layer's experts read ahead (``GLM53_RAM_TIER_READ_AHEAD``), out of the budget.
    :raise RamBudgetError: the budget holds fewer blocks than one layer's experts (the window).
    """
    if budget_bytes >= store.arena_bytes:
        return None
    block, E = store.layout.block_bytes, store.num_experts
    if budget_bytes < E * block:
        raise RamBudgetError(
            f"{what} gives {budget_bytes / 1e9:.2f} GB for routed experts, {budget_bytes // block} blocks of {block / 1e6:.2f} MB; "
            f"one MoE layer's forward can pick all of its {E} experts (a prefill's does), which must be in RAM together: give at "
            f"least {E * block / 1e9:.2f} GB (GLM53_HOST_RAM_GB), or free host memory")
    ahead = min(ahead, budget_bytes // block - E)  # what the budget has room for beside the window
    slots = min(budget_bytes // block - E - ahead, (store.num_layers - 1) * E)  # more would hold the store: no tier at all
    return TierPlan(int(slots), E, block, int(ahead))


@dataclasses.dataclass(frozen=True)
class TierPolicy:
    """The parameters of the tier's policy slots' replacement: the expert cache's policy (``cache_policy``'s
    ``ReferenceCache.step``, the same definition as VRAM's) over the picks the VRAM cache missed.

    The defaults were the VRAM cache's own when they were chosen (decay 0.999, recency weight 800; ``cache.Policy``
    has since moved to 0.995 / 200 on the engine's trace, bench/results/2026-12-02-cache-policy-engine-trace.md, and
    the tier's were not replayed against that yet), with the VRAM residents at their warm scores. In ``bench/ram_tier_sim.py``'s search on the
    engine's trace and both presets' CPU twins at 50 % and 25 % they rank third, within 0.2 % of the best mean, and
    unlike the two above them they read no more from disk than the first policy on held-out twins either
    (bench/results/2026-12-02-ram-tier-policy.md).

    Beside the VRAM cache's retuned policy (0.995 / 200) those slots duplicated up to 144 of 1440 VRAM residents;
    ``exclusive`` (after 32 steps in VRAM) reads 4-13 % less from disk than sharing on the engine's trace and every
    twin, held-out ones too, and 1-2.4 % less in 97-step windows of the engine's trace (bench.compare's arm), whose
    first 32 steps it cannot change (bench/results/2026-12-04-ram-tier-exclusive.md).
    """

    decay: float = 0.999  # of the slow score (popularity)
    hysteresis: float = 1.25  # a candidate's score must beat the weakest resident's times this
    recency_decay: float = 0.5  # of the fast score
    recency_weight: float = 800.0  # the fast score's weight per unit of reuse lift above popularity's (0: none)
    recency_keep: float = 0.99  # of the running reuse lift, per step
    vram_score: float = 1.0  # the VRAM cache's residents' starting scores, as a share of their warm ones
    exclusive: bool = True  # a policy slot whose expert VRAM has held for ``exclusive_after`` steps goes first
    exclusive_after: int = 32  # decode steps of the layer in a row VRAM must hold an expert before its slot goes first

    def __post_init__(self):
        checks = (("decay", 0.0 < self.decay <= 1.0, "in (0, 1]"),
                  ("hysteresis", 1.0 <= self.hysteresis < math.inf, "at least 1 and finite"),
                  ("recency_decay", 0.0 < self.recency_decay < 1.0, "in (0, 1)"),
                  ("recency_weight", 0.0 <= self.recency_weight < math.inf, "at least 0 and finite"),
                  ("recency_keep", 0.0 <= self.recency_keep < 1.0, "in [0, 1)"),
                  ("vram_score", 0.0 <= self.vram_score <= 1.0, "in [0, 1]"),
                  ("exclusive", isinstance(self.exclusive, bool), "True or False"),
                  ("exclusive_after", isinstance(self.exclusive_after, int) and self.exclusive_after >= 1, "an int, at least 1"))
        for name, ok, accepted in checks:
            if not ok:  # a NaN fails every comparison, so it lands here too
                raise ValueError(f"TierPolicy.{name}={getattr(self, name)!r} is not accepted: it must be {accepted}")

    @classmethod
    def from_settings(cls, settings) -> TierPolicy:
        """The default policy with what ``GLM53_RAM_TIER_DECAY`` / ``_HYSTERESIS`` / ``_RECENCY_WEIGHT`` /
        ``_VRAM_SCORE`` / ``_EXCLUSIVE`` set (unset: the defaults): the GPU's A/B of the tier's policy without a code
        change; with ``GLM53_RAM_TIER_WRITE_BACK`` exclusive at once."""
        policy = cls(**config.given(settings, decay="ram_tier_decay", hysteresis="ram_tier_hysteresis",
                                    recency_weight="ram_tier_recency_weight", vram_score="ram_tier_vram_score",
                                    exclusive="ram_tier_exclusive"))
        # with the write-back an expert VRAM evicts comes back into a slot without a disk read, so the slot of one VRAM
        # holds goes at once (the classic exclusive hierarchy): in the replay, 12.10 disk reads a token on the engine's
        # trace at 50 % RAM against 12.89 after 32 steps (13.37 without the write-back), and less on every twin
        # (bench/results/2026-12-04-ram-tier-exclusive.md)
        return dataclasses.replace(policy, exclusive_after=1) if settings.ram_tier_write_back else policy

    @property
    def recency(self) -> Recency:
        return Recency(self.recency_decay, self.recency_weight, self.recency_keep)

    def state(self, profile: np.ndarray, top_k: int, vram_slots: int, policy_slots: int) -> TierState:
        """The policy slots' starting state: after the ``vram_slots`` experts the VRAM cache takes from ``profile``
        (float [layers, experts]), the next ``policy_slots`` by ``placement``; the scores at the profile's steady
        state, the VRAM residents' times ``vram_score`` (0: as the picks that reach the tier would leave them; 1: as
        if every pick reached it, so an expert the VRAM cache evicts comes with its popularity); the reuse lift
        measured against what popularity alone gives the picks that reach the tier."""
        vram = placement(profile, vram_slots)
        ours = placement(profile, len(vram) + policy_slots)[len(vram):]
        freq = warm_scores(profile, top_k, self.decay)
        recent = warm_scores(profile, top_k, self.recency_decay)
        for layer, expert in vram:
            freq[layer, expert] *= np.float32(self.vram_score)
            recent[layer, expert] *= np.float32(self.vram_score)
        return TierState(freq, ours, recent, _missed_popularity_lift(profile, top_k, vram))

    def step(self, state: TierState, layer: int, missed: np.ndarray, vram: np.ndarray) -> list[Admission]:
        """A decode step of ``layer`` on the picks the VRAM cache missed (:func:`missed`) with the layer's VRAM
        residency when they were missed (``vram`` int [experts], each expert's VRAM slot or -1): the cache policy's
        step, admitting up to every distinct miss (an admission costs no extra read: the bytes are read anyway).

        With ``exclusive``, the slot of an expert VRAM has held for the last ``exclusive_after`` decode steps of the
        layer (``TierState.vram_held``, counted here) is given up first (``ReferenceCache.step``'s ``spare``), so
        the slots hold what VRAM lacks. The cost: such an expert, once VRAM evicts it, is read from disk when next
        missed unless it took a slot again. Not at once: the VRAM cache admits experts its recency favours and
        evicts many of them again within a few steps; their RAM slots are kept (on the trained twins, giving up at
        once read 3-12 % more from disk than sharing, bench/results/2026-12-04-ram-tier-exclusive.md)."""
        sel = np.asarray(missed, dtype=np.int64)
        flat = sel.reshape(-1)
        distinct = np.unique(flat[(flat >= 0) & (flat < state.num_experts)]).size
        held = state.vram_held[layer]
        held[:] = np.where(np.asarray(vram) >= 0, held + 1, 0)
        spare = held >= self.exclusive_after if self.exclusive else None
        return state.step(layer, sel, self.decay, self.hysteresis, distinct, self.recency, spare)

    def write_back(self, state: TierState, layer: int, expert: int, held: np.ndarray, busy) -> Admission | None:
        """Take ``expert``, which the VRAM cache is evicting, into a policy slot of ``layer`` unless one holds it: the
        slot of an expert VRAM holds (``held`` bool [experts], the residency after the VRAM cache's step) that
        :meth:`step` gives up first, the lowest-scored, else the lowest-scored other resident's when the expert's
        score beats it by the hysteresis; never the slot of an expert read in this step (``busy``: ids). The scores
        are those the layer's :meth:`step` left. Returns the admission (its slot, the expert it evicts), or None.

        What ``bench/ram_tier_sim.py`` estimated before the engine had it: 4-10 % fewer disk reads on the engine's
        trace at 50 % and 25 % RAM, 8-22 % on the trained twins (bench/results/2026-12-04-ram-tier-exclusive.md)."""
        slot_of = state.slot_of[layer]
        if slot_of[expert] >= 0:
            return None
        s = state.scores(layer, self.recency_weight)
        victim = slot_of >= 0
        victim[np.asarray(busy, dtype=np.int64)] = False
        if not victim.any():
            return None
        if not self.exclusive:
            spare = np.zeros_like(victim)
        elif self.exclusive_after > 1:
            spare = victim & held & (state.vram_held[layer] >= self.exclusive_after)
        else:  # given up at once: any VRAM holds now, the expert VRAM admitted in its place too
            spare = victim & held
        pool = spare if spare.any() else victim
        v = int(np.flatnonzero(pool)[np.argmin(s[pool])])
        if not spare.any() and not s[expert] > np.float32(self.hysteresis) * s[v]:
            return None
        slot = int(slot_of[v])
        slot_of[v], slot_of[expert] = -1, slot
        state.owner[slot] = layer * state.num_experts + expert
        return Admission(expert, slot, v)


class TierState(ReferenceCache):
    """The policy slots' state: the cache policy's, and ``vram_held`` int32 [layers, experts], the decode steps of
    the layer in a row (to the last) at whose start the VRAM cache held each expert (0 at start)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vram_held = np.zeros(self.freq.shape, dtype=np.int32)


def missed(picks: np.ndarray, vram_slot_of: np.ndarray) -> np.ndarray:
    """``picks`` (int [..., top_k], the last axis a row) with -1 where the VRAM cache holds the expert
    (``vram_slot_of`` int [experts] >= 0) or the entry is no expert: what reaches the tier, its rows kept (the
    policy measures the reuse lift on the first)."""
    picks = np.asarray(picks, dtype=np.int64)
    valid = (picks >= 0) & (picks < vram_slot_of.shape[0])
    return np.where(valid & (vram_slot_of[np.where(valid, picks, 0)] < 0), picks, -1)


def _missed_popularity_lift(profile: np.ndarray, top_k: int, vram: list[tuple[int, int]]) -> np.ndarray:
    """float32 [layers]: ``popularity_lift`` of the picks that miss the VRAM residents ``vram``: an expert outside
    VRAM reaches the tier as often as it is picked, one inside never."""
    outside = np.array(profile, dtype=np.float64)
    for layer, expert in vram:
        outside[layer, expert] = 0.0
    totals = np.asarray(profile, dtype=np.float64).sum(axis=1)
    reach = np.where(totals > 0, outside.sum(axis=1) / np.maximum(totals, 1e-30), 0.0)  # share of the picks that miss
    return np.array([popularity_lift(outside[l:l + 1], top_k * reach[l])[0] for l in range(outside.shape[0])], dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Served:
    """Where one layer step's missed experts came from: ``ram`` in a policy slot already, ``disk`` read now (of which
    ``ahead_used`` were read ahead, of the ``guessed`` experts read ahead for this step)."""

    ram: list[int]
    disk: list[int]
    guessed: int = 0
    ahead_used: int = 0


class ReadAhead(NamedTuple):
    """Experts of ``layer`` being read ahead: each one's ahead entry (its role in ``RamTier.blocks``), the reads'
    batch and, per read, its expert."""

    layer: int
    entry: dict[int, int]
    batch: Batch | None
    owner: list[int]


NO_AHEAD = ReadAhead(-1, {}, None, [])


def _wait(batch: Batch | None) -> None:
    if batch is not None:
        batch.wait()


class RamTier:
    """The tier's slots and their bookkeeping over ``store``'s layout, read with ``reader`` (opened on
    ``store.shard_files()``). The arena is allocated here; :meth:`start` places and reads the policy slots.
    """

    def __init__(self, store: HostStore, reader: DiskReader, tier: TierPlan):
        self.store, self.reader, self.plan = store, reader, tier
        self._file = {f: i for i, f in enumerate(reader.paths)}
        self._sources: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}  # (layer, expert) -> its reads
        missing = [f for f in store.shard_files() if f not in self._file]
        if missing:
            raise ValueError(f"the disk reader does not read {missing[0]}, which holds experts")
        self._map = mmap.mmap(-1, tier.bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.arena = np.frombuffer(self._map, dtype=np.uint8)  # [policy slots + window] blocks
        # the arena block playing each role: policy slot s at [s], window entry e at [policy_slots + e], ahead entry j
        # at [policy_slots + window_slots + j] (a permutation)
        self.blocks = np.arange(tier.slots, dtype=np.int64)
        self._ahead: ReadAhead | None = None  # the next layer's experts being read ahead
        self.policy: TierState | None = None  # the policy slots' state
        self.parameters = TierPolicy()
        self._window: tuple[int, set[int]] = (-1, set())  # the layer and experts the window holds
        # admitted: into any slot; given_up: of those, into the slot of an expert VRAM held (``TierPolicy.exclusive``)
        # ahead: experts read ahead; ahead_used: of those, picked and read in full in time (no read of their own)
        # written_back: experts the VRAM cache evicted, copied from their VRAM slot into a policy slot (no disk read)
        self.reads = {"load": 0, "ram": 0, "disk": 0, "admitted": 0, "given_up": 0, "fetched": 0, "ahead": 0, "ahead_used": 0,
                      "written_back": 0}
        self._serving = False
        self.timing = {"start_bytes": 0, "start_seconds": 0.0, "bytes": 0, "seconds": 0.0}  # the disk's rate as read
        # where a decode layer's step spends its time on the host: the policy's bookkeeping, which runs while the disk
        # reads, then the wait for the reads left; read_seconds: submitted to done, over the steps that read
        self.decode_timing = {"policy_seconds": 0.0, "placed_seconds": 0.0, "wait_seconds": 0.0, "read_seconds": 0.0,
                              "read_experts": 0}
        self._device_base = 0  # the arena's device address, once pinned
        self._unpin: Callable[[], None] | None = None

    # ---- start

    def start(self, profile: np.ndarray, top_k: int, vram_slots: int, policy: TierPolicy = TierPolicy()) -> None:
        """Place the policy slots after the ``vram_slots`` experts the VRAM cache takes from the same ``profile``
        (float [layers, experts]), replaced by ``policy`` (:meth:`TierPolicy.state`), and read them from disk.

        :raise DiskReadError: a read failed (the tier is not usable).
        """
        self.parameters = policy
        self.policy = policy.state(profile, top_k, vram_slots, self.plan.policy_slots)
        E = self.store.num_experts
        t0 = time.perf_counter()
        self._read([(int(o) // E, int(o) % E, s) for s, o in enumerate(self.policy.owner)])
        self.timing["start_seconds"] += time.perf_counter() - t0
        self.timing["start_bytes"] += len(self.policy.owner) * self.plan.block_bytes
        self.reads["load"] += len(self.policy.owner)
        self._serving = True

    def pin(self, register: Callable[[int, int], None], unregister: Callable[[int], None],
            device_view: Callable[[object], object]) -> object:
        """Page-lock and map the arena for the GPU (``register(address, nbytes)``, as the host store's arenas) and
        return ``device_view(arena as a CPU uint8 tensor)``: its CUDA alias, whose first window block is expert 0's."""
        host = torch.from_numpy(self.arena)
        register(host.data_ptr(), host.numel())
        self._unpin = lambda: unregister(host.data_ptr())
        cuda = device_view(host)
        self._device_base = int(cuda.data_ptr())
        return cuda

    def unpin(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self._device_base = 0

    def read_into(self, pairs: list[tuple[int, int]], dests: list[np.ndarray]) -> None:
        """Read expert blocks from disk into caller memory.

        :raise DiskReadError: a read failed.
        """
        self.reader.read([r for (layer, expert), dest in zip(pairs, dests) for r in self._block_reads(layer, expert, dest)])

    def batches(self, pairs: list[tuple[int, int]], wait: Callable[[], None]) -> Iterator[tuple[list[int], list[np.ndarray]]]:
        """The blocks of ``pairs`` (layer, expert) a layer at a time, read into the window: yields the indices into
        ``pairs`` of one layer's experts and their window blocks; ``wait()`` is called before the window is read into
        again (the caller's copies out of it must be done: a device synchronisation). What the VRAM cache fills its
        slots from at start.

        :raise DiskReadError: a read failed.
        """
        by_layer: dict[int, list[int]] = {}
        for i, (layer, _) in enumerate(pairs):
            by_layer.setdefault(layer, []).append(i)
        window = self.plan.policy_slots
        for layer, indices in sorted(by_layer.items()):
            wait()
            self._window = (-1, set())
            blocks = [self._slot(window + pairs[i][1]) for i in indices]
            self.read_into([pairs[i] for i in indices], blocks)
            yield indices, blocks
        wait()

    # ---- a layer's step

    def step(self, layer: int, missed, vram: np.ndarray, placed: Callable[[], None] | None = None) -> Served:
        """A decode step of ``layer`` for the picks the VRAM cache missed (int, any shape, the last axis a row, as
        :func:`missed` gives them: -1 for none, repeats allowed) with the layer's VRAM residency (``vram`` int
        [experts], slot or -1; :meth:`TierPolicy.step`): every missed expert no policy slot holds is read from disk
        into its window entry while the policy's step runs, and those the policy admitted take their window entry's
        block into their slot (module docstring). Then, the reads still in flight, every missed expert's block is
        decided and ``placed()`` is called (the caller points the tables there: :meth:`address` gives each one's);
        nothing may read those bytes before this returns. When it returns, each missed expert's bytes are at
        :meth:`block`; a slot given up by an expert VRAM holds holds another's, and that expert has no block here
        (:meth:`address` -1) until it is missed again.

        :raise DiskReadError: a read failed: the step's admissions are undone, the slots keep their bytes, the
            expert it was for is in no slot, and nothing was served (what ``placed`` pointed at is not to be read).
        """
        sel = np.asarray(missed, dtype=np.int64)
        picked = self._distinct(sel.reshape(-1))
        slot_of = self.policy.slot_of[layer]
        ram = [e for e in picked if slot_of[e] >= 0]
        disk = [e for e in picked if slot_of[e] < 0]
        window = self.plan.policy_slots
        self._window = (-1, set())  # until the reads are in: the window's last layer is overwritten now
        t0 = time.perf_counter()
        guessed = len(self._ahead.entry) if self._ahead is not None and self._ahead.layer == layer else 0
        ahead = self._ahead_for(layer, disk)  # the wrong guesses' reads dropped first, so that they do not hold the disk
        reads = [(layer, e, window + e) for e in disk if e not in ahead.entry]
        batch = self._submit(reads)
        try:
            admitted = {a.expert: a for a in self.parameters.step(self.policy, layer, sel, vram)}  # while the disk reads
        except BaseException:
            self._finish(batch, len(reads))  # no read is left in flight into the window or the ahead entries
            _wait(ahead.batch)
            raise
        # every block is decided now, the bytes still landing: a guess read ahead takes its block into its window entry,
        # then an admitted expert (every one is a disk one: the policy admits only picks no slot holds) its window
        # entry's block into its slot; the blocks the reads go to are not those the exchanges hand to others
        moves = [(window + e, role) for e, role in ahead.entry.items()] + [(int(slot_of[e]), window + e) for e in admitted]
        for a, b in moves:
            self._exchange(a, b)
        self._window = (layer, {e for e in disk if e not in admitted})
        t1 = time.perf_counter()
        try:
            try:
                if placed is not None:
                    placed()  # the host's part of the layer, while the disk reads
            finally:
                t2 = time.perf_counter()
                try:
                    self._finish(batch, len(reads))
                finally:
                    _wait(ahead.batch)
            # a guess whose read did not finish whole is read again where its block now plays its role
            late = self._late_ahead(ahead)
            self._read([(layer, e, int(slot_of[e]) if e in admitted else window + e) for e in late])
        except DiskReadError:
            self._undo(layer, admitted, moves)
            raise
        self.reads["ahead_used"] += len(ahead.entry) - len(late)  # counted once they have served: a failed step's are not
        t3 = time.perf_counter()
        self.decode_timing["policy_seconds"] += t1 - t0
        self.decode_timing["placed_seconds"] += t2 - t1
        self.decode_timing["wait_seconds"] += t3 - t2
        if disk:
            self.decode_timing["read_seconds"] += t3 - t0
            self.decode_timing["read_experts"] += len(disk)
        self.reads["ram"] += len(ram)
        self.reads["disk"] += len(disk)
        self.reads["admitted"] += len(admitted)
        self.reads["given_up"] += sum(1 for a in admitted.values() if vram[a.evicted] >= 0)
        return Served(ram, disk, guessed, len(ahead.entry) - len(late))

    def fetch(self, layer: int, experts, placed: Callable[[], None] | None = None) -> Served:
        """Any other forward's step of ``layer`` (a prefill's): the experts (ids, repeats allowed) that no policy slot
        holds are read into the window; the policy is not told (its scores follow decode, as the VRAM cache's).
        ``placed`` as :meth:`step`'s: called while the disk reads, every expert's block decided.

        :raise DiskReadError: a read failed; the window holds none of the layer's experts afterwards.
        """
        self._drop_ahead()
        picked = self._distinct(np.asarray(experts, dtype=np.int64).reshape(-1))
        slot_of = self.policy.slot_of[layer]
        ram = [e for e in picked if slot_of[e] >= 0]
        have = self._window[1] if self._window[0] == layer else set()
        disk = [e for e in picked if e not in ram and e not in have]
        self._window = (layer, have | set(disk))
        try:
            submitted = self._submit([(layer, e, self.plan.policy_slots + e) for e in disk])
            try:
                if placed is not None:
                    placed()
            finally:
                self._finish(submitted, len(disk))
        except DiskReadError:
            self._window = (-1, set())
            raise
        self.reads["fetched"] += len(disk)
        return Served(ram, disk)

    def read_ahead(self, layer: int, experts) -> int:
        """Start reading ``experts`` (ids, likeliest first) of ``layer`` into the ahead entries, at most
        ``plan.ahead_slots`` of them, skipping those a policy slot holds; returns how many. Nothing waits for them:
        the next :meth:`step` of ``layer`` takes those it needs whose reads are done or in flight, and drops the
        others' pieces not begun, so that a wrong guess costs the disk what it read while the GPU computed; any other
        call of this tier drops them all. Only where bytes come from changes: an expert is served from its ahead
        entry only when its read finished whole (else :meth:`step` reads it again)."""
        self._drop_ahead()
        slot_of = self.policy.slot_of[layer]
        chosen = [int(e) for e in dict.fromkeys(int(e) for e in experts) if 0 <= e < self.store.num_experts and slot_of[e] < 0]
        chosen = chosen[:self.plan.ahead_slots]
        if not chosen:
            return 0
        first = self.plan.policy_slots + self.plan.window_slots
        reads, owner = [], []
        for j, e in enumerate(chosen):
            block_reads = self._block_reads(layer, e, self._slot(first + j))
            reads += block_reads
            owner += [e] * len(block_reads)
        batch = self.reader.submit(reads, piece_bytes=min(AHEAD_PIECE_BYTES, self.reader.piece_bytes))
        self._ahead = ReadAhead(layer, {e: first + j for j, e in enumerate(chosen)}, batch, owner)
        self.reads["ahead"] += len(chosen)
        return len(chosen)

    def slot_index(self, layer: int, expert: int) -> int:
        """The arena block holding the expert (its policy slot's, or its window entry's when the window holds the
        layer's), or -1."""
        slot = int(self.policy.slot_of[layer, expert])
        if slot >= 0:
            return int(self.blocks[slot])
        if self._window[0] == layer and expert in self._window[1]:
            return int(self.blocks[self.plan.policy_slots + expert])
        return -1

    def prefill_blocks(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where prefill staging copies ``experts`` (int ids) of ``layer`` from: whether a policy slot holds each
        (bool), and its arena block: that slot's, else its window entry's, where :meth:`fetch` reads it."""
        experts = np.asarray(experts, dtype=np.int64)
        slot = self.policy.slot_of[layer, experts].astype(np.int64)
        held = slot >= 0
        return held, self.blocks[np.where(held, slot, self.plan.policy_slots + experts)]

    def block_address(self, index) -> np.ndarray:
        """The device address of arena block(s) ``index`` (after :meth:`pin`)."""
        return self._device_base + np.asarray(index, dtype=np.int64) * self.plan.block_bytes

    def address(self, layer: int, expert: int) -> int:
        """The device address of the expert's block (after :meth:`pin`), or -1 when the tier does not hold it."""
        index = self.slot_index(layer, expert)
        return -1 if index < 0 else int(self.block_address(index))

    def write_back(self, layer: int, experts, held: np.ndarray, busy) -> list[tuple[int, int]]:
        """The VRAM cache is evicting ``experts`` of ``layer`` in this decode step (after :meth:`step`, before the
        cache's own step), ``held`` bool [experts] its residency after that step, ``busy`` the ids this step read: those
        the policy takes back (:meth:`TierPolicy.write_back`) get a policy slot. Returns (expert, arena block) for
        each: the caller copies the expert's bytes from its VRAM slot into that block before the cache's step
        overwrites the slot (and before anything reads the block), and points its ``home`` there; the slot's expert
        before it is in no slot of the tier (its ``home`` stale until it is missed again)."""
        out = []
        for e in experts:
            admission = self.parameters.write_back(self.policy, layer, int(e), held, busy)
            if admission is not None:
                out.append((admission.expert, int(self.blocks[admission.slot])))
        self.reads["written_back"] += len(out)
        return out

    def host_block(self, block: int) -> torch.Tensor:
        """Arena block ``block`` as a CPU tensor (page-locked after :meth:`pin`): where a copy from VRAM lands in it."""
        return torch.from_numpy(self._view(block))

    def host_address(self, device_addresses) -> np.ndarray:
        """The host addresses of the arena bytes at ``device_addresses`` (after :meth:`pin`): where the CPU reads what
        the GPU reads there (fast mode's CPU tier).

        :raise ValueError: an address outside the arena."""
        at = np.asarray(device_addresses, dtype=np.int64) - self._device_base
        if at.size and (at.min() < 0 or at.max() >= self.arena.nbytes):
            raise ValueError(f"device addresses {at.min() + self._device_base:#x}..{at.max() + self._device_base:#x} are "
                             f"not all in the RAM tier's arena at {self._device_base:#x} ({self.arena.nbytes} bytes)")
        return self.arena.ctypes.data + at

    def policy_block(self, layer: int, expert: int) -> np.ndarray | None:
        """The expert's block when a policy slot holds it (not the window, which the next layer's reads reuse)."""
        slot = int(self.policy.slot_of[layer, expert])
        return self._slot(slot) if slot >= 0 else None

    def block(self, layer: int, expert: int) -> np.ndarray | None:
        """The expert's block in this tier, or None when the tier does not hold it."""
        index = self.slot_index(layer, expert)
        return None if index < 0 else self._view(index)

    def verify(self) -> list[str]:
        """Every policy slot holds its expert's bytes (read again from disk to compare)."""
        problems = []
        E, b = self.store.num_experts, self.plan.block_bytes
        for slot, owner in enumerate(self.policy.owner):
            layer, expert = int(owner) // E, int(owner) % E
            fresh = np.zeros(b, dtype=np.uint8)
            self.read_into([(layer, expert)], [fresh])
            for _, _, n, off in self.store.block_sources(layer, expert):
                if not np.array_equal(fresh[off:off + n], self._slot(slot)[off:off + n]):
                    problems.append(f"slot {slot} does not hold expert {expert} of {self.store.layer_keys[layer]}")
                    break
        return problems

    def stats(self) -> dict:
        t = self.timing
        rate = lambda n, s: round(n / s / 1e9, 3) if s > 0 else None
        return {"policy_slots": self.plan.policy_slots, "window_slots": self.plan.window_slots, "ahead_slots": self.plan.ahead_slots,
                "bytes": self.plan.bytes,
                "share_of_experts": round(self.plan.policy_slots / (self.store.num_layers * self.store.num_experts), 4),
                "policy": dataclasses.asdict(self.parameters), "served": dict(self.reads), "disk": self.reader.counters(),
                "disk_files": self.reader.summary(),
                "disk_gbs": {"start": rate(t["start_bytes"], t["start_seconds"]), "serving": rate(t["bytes"], t["seconds"])},
                "read_seconds": round(t["seconds"], 3),
                "decode": {"policy_seconds": round(self.decode_timing["policy_seconds"], 3),
                           "placed_seconds": round(self.decode_timing["placed_seconds"], 3),
                           "wait_seconds": round(self.decode_timing["wait_seconds"], 3),
                           "read_seconds": round(self.decode_timing["read_seconds"], 3),
                           "read_experts": self.decode_timing["read_experts"],
                           "read_gbs": rate(self.decode_timing["read_experts"] * self.plan.block_bytes, self.decode_timing["read_seconds"])}}

    # ---- reading

    def _distinct(self, sel: np.ndarray) -> list[int]:
        return [int(e) for e in np.unique(sel[(sel >= 0) & (sel < self.store.num_experts)])]

    def _view(self, block: int) -> np.ndarray:
        b = self.plan.block_bytes
        return self.arena[block * b:(block + 1) * b]

    def _slot(self, role: int) -> np.ndarray:
        """The block playing ``role`` (policy slot ``s``, or window entry ``policy_slots + e``)."""
        return self._view(int(self.blocks[role]))

    def _exchange(self, a: int, b: int) -> None:
        self.blocks[[a, b]] = self.blocks[[b, a]]

    def _ahead_for(self, layer: int, disk: list[int]) -> ReadAhead:
        """The reads ahead a step of ``layer`` that reads ``disk`` can use, the others' pieces not begun dropped (the
        step waits for the whole batch before it returns), or none (a guess for another layer: dropped and waited for)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.layer != layer:
            if ahead is not None:
                ahead.batch.cancel()
                _wait(ahead.batch)
            return NO_AHEAD
        wanted = set(disk)
        ahead.batch.cancel([i for i, e in enumerate(ahead.owner) if e not in wanted])
        return ReadAhead(layer, {e: role for e, role in ahead.entry.items() if e in wanted}, ahead.batch, ahead.owner)

    def _late_ahead(self, ahead: ReadAhead) -> list[int]:
        """After ``ahead``'s reads have finished: the experts among its (used) guesses whose read did not finish whole."""
        if not ahead.entry:
            return []
        failed = {e for e, ok in zip(ahead.owner, ahead.batch.done()) if not ok}
        return [e for e in ahead.entry if e in failed]

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.batch.cancel()
            _wait(self._ahead.batch)
            self._ahead = None

    def _block_reads(self, layer: int, expert: int, dest: np.ndarray) -> list[Read]:
        sources = self._sources.get((layer, expert))
        if sources is None:  # once an expert: its file's index, where its projections lie and go (a decode step's host time)
            sources = self._sources[(layer, expert)] = [(self._file[Path(f)], at, n, off)
                                                        for f, at, n, off in self.store.block_sources(layer, expert)]
        return [Read(file, at, n, dest[off:off + n]) for file, at, n, off in sources]

    def _submit(self, targets: list[tuple[int, int, int]]) -> tuple[Batch | None, float]:
        """Start reading ``targets`` ((layer, expert, role)); :meth:`_finish` waits for them."""
        reads = [r for layer, e, role in targets for r in self._block_reads(layer, e, self._slot(role))]
        return (self.reader.submit(reads) if reads else None), time.perf_counter()

    def _finish(self, submitted: tuple[Batch | None, float], experts: int) -> None:
        """Wait for :meth:`_submit`'s reads of ``experts`` expert blocks.

        :raise DiskReadError: the first that failed (all have finished).
        """
        batch, t0 = submitted
        if batch is None:
            return
        batch.wait()
        if self._serving:  # the start's reads are timed apart
            self.timing["seconds"] += time.perf_counter() - t0
            self.timing["bytes"] += experts * self.plan.block_bytes
        errors = batch.errors()
        if errors:
            raise errors[0]

    def _read(self, targets: list[tuple[int, int, int]]) -> None:
        self._finish(self._submit(targets), len(targets))

    def _undo(self, layer: int, admitted: dict, moves: list[tuple[int, int]]) -> None:
        """After a failed read: the step's exchanges of blocks (``moves``) are reversed and its admitted experts leave
        their slots, which go back to the experts they evicted with their old blocks (which no read of the step went
        to: their bytes are intact); the window holds nothing."""
        for a, b in reversed(moves):
            self._exchange(a, b)
        E = self.store.num_experts
        for a in admitted.values():
            self.policy.slot_of[layer, a.expert] = -1
            self.policy.slot_of[layer, a.evicted] = a.slot
            self.policy.owner[a.slot] = layer * E + a.evicted
        self._window = (-1, set())
