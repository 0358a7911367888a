"""The RAM tier: where host RAM cannot hold every routed expert, a budget of expert slots over the checkpoint's own
files, between the GPU expert cache and the disk.

With a budget that holds the host store (:func:`plan` gives None) nothing changes: the store reads every expert
once at start and the disk is not read again. Otherwise the tier has two kinds of slot, each one expert block in
the host store's ``[gate | up | down]`` layout (so that a VRAM admission stays one contiguous copy), in one arena:

- **policy slots**, partitioned between the layers at start by the routing profile and replaced by the expert
  cache's own policy (``cache_policy.ReferenceCache``: one definition, here a second instance of it, over the picks
  the VRAM cache missed). At start they hold the hottest experts after the ones the VRAM cache takes, and the scores
  of those VRAM residents start at zero, as the picks that reach this tier would leave them;
- **staging slots**, one layer's active experts (``top_k`` a token x the decode rows): where a disk miss the policy
  does not keep lands for the step that needs it (and what a VRAM admission then copies from).

A layer's step (:meth:`RamTier.step`, given the experts the VRAM cache missed): the policy's step decides the
admissions; each missed expert that was not in a policy slot is read from disk, into the slot the policy gave it
or into a staging slot. Admission costs no extra read (the bytes are read anyway), so ``max_admit`` is every miss,
and the hysteresis alone keeps one-off picks from evicting warmer experts. A read that fails fails the step
(:class:`~glm53.offload.disk.DiskReadError`); the expert it was for is in no slot afterwards, and a victim whose
slot it was read into is marked stale and read again when next picked, so nothing is served from a failed read.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cache_policy import ReferenceCache, placement, warm_scores
from .disk import DiskReader, DiskReadError, Read
from .host_store import HostStore


class RamBudgetError(ValueError):
    """A RAM budget below what one layer's decode step needs at once; the message says how much is needed."""


@dataclass(frozen=True)
class TierPlan:
    policy_slots: int
    staging_slots: int
    block_bytes: int

    @property
    def bytes(self) -> int:
        return (self.policy_slots + self.staging_slots) * self.block_bytes


def plan(store: HostStore, budget_bytes: int, top_k: int, decode_rows: int, what: str = "the RAM budget") -> TierPlan | None:
    """The tier a budget of host bytes for expert blocks gives, or None when it holds the whole host store.

    :param what: how the budget was set, for the message (``GLM53_HOST_RAM_GB=40``).
    :raise RamBudgetError: the budget holds fewer blocks than one layer's decode step touches.
    """
    if budget_bytes >= store.arena_bytes:
        return None
    block = store.layout.block_bytes
    active = min(store.num_experts, top_k * decode_rows)
    if budget_bytes < active * block:
        raise RamBudgetError(
            f"{what} gives {budget_bytes / 1e9:.2f} GB for routed experts, {budget_bytes // block} blocks of {block / 1e6:.2f} MB; "
            f"one MoE layer's decode step can touch {active} experts ({top_k} a token x {decode_rows} rows), which must be in "
            f"RAM together: give at least {active * block / 1e9:.2f} GB (GLM53_HOST_RAM_GB), or free host memory")
    slots = min(budget_bytes // block - active, store.num_layers * store.num_experts)
    return TierPlan(int(slots), active, block)


@dataclass(frozen=True)
class Served:
    """Where one layer step's missed experts came from: ``ram`` in a policy slot already, ``disk`` read now."""

    ram: list[int]
    disk: list[int]


class RamTier:
    """The tier's slots and their bookkeeping over ``store``'s layout, read with ``reader`` (opened on
    ``store.shard_files()``).

    :param profile: float [layers, experts] picks per expert, the VRAM cache's start profile.
    :param vram_slots: the slots the VRAM cache fills from the same profile: those experts start outside this tier.
    :param decay, hysteresis: the cache policy's (``cache.Policy``).
    """

    def __init__(self, store: HostStore, reader: DiskReader, tier: TierPlan, profile: np.ndarray, top_k: int,
                 vram_slots: int, decay: float, hysteresis: float):
        self.store, self.reader, self.plan = store, reader, tier
        self.decay, self.hysteresis = decay, hysteresis
        self._file = {f: i for i, f in enumerate(reader.paths)}
        missing = [f for f in store.shard_files() if f not in self._file]
        if missing:
            raise ValueError(f"the disk reader does not read {missing[0]}, which holds experts")
        vram = placement(profile, vram_slots)
        ours = placement(profile, len(vram) + tier.policy_slots)[len(vram):]
        scores = warm_scores(profile, top_k, decay)
        for layer, expert in vram:
            scores[layer, expert] = 0.0
        self.policy = ReferenceCache(scores, ours)
        self.stale = np.zeros(len(ours), dtype=bool)
        self._map = mmap.mmap(-1, max(tier.bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.arena = np.frombuffer(self._map, dtype=np.uint8)  # [slots + staging] blocks; pinned with the store's register
        self._staged: dict[tuple[int, int], int] = {}  # (layer, expert) -> staging slot, for the last step
        self.reads = {"load": 0, "ram": 0, "disk": 0, "admitted": 0}

    # ---- start

    def load(self) -> None:
        """Read every policy slot's expert from disk.

        :raise DiskReadError: a read failed (the tier is not usable).
        """
        owners = self.policy.owner
        E = self.store.num_experts
        self._read([(int(o) // E, int(o) % E, s) for s, o in enumerate(owners)])
        self.reads["load"] += len(owners)

    def read_into(self, pairs: list[tuple[int, int]], dests: list[np.ndarray]) -> None:
        """Read expert blocks from disk into caller memory (the VRAM cache's warm start, through its pinned buffer).

        :raise DiskReadError: a read failed.
        """
        self.reader.read([r for (layer, expert), dest in zip(pairs, dests) for r in self._block_reads(layer, expert, dest)])

    # ---- a decode step

    def step(self, layer: int, missed) -> Served:
        """One layer's step for the experts the VRAM cache missed (any int array of expert ids, repeats allowed):
        the policy's step, then every missed expert not in a policy slot read from disk. When this returns, each
        missed expert's bytes are at :meth:`block`.

        :raise DiskReadError: a read failed: the expert it was for is in no slot, and nothing was served.
        """
        sel = np.asarray(missed, dtype=np.int64).reshape(-1)
        picked = [int(e) for e in np.unique(sel[(sel >= 0) & (sel < self.store.num_experts)])]
        slot_of = self.policy.slot_of[layer]
        ram = [e for e in picked if slot_of[e] >= 0 and not self.stale[slot_of[e]]]
        stale = {e for e in picked if slot_of[e] >= 0 and self.stale[slot_of[e]]}
        if len(picked) - len(ram) > self.plan.staging_slots:
            raise ValueError(f"{len(picked) - len(ram)} experts to read in one step of a layer, more than the "
                             f"{self.plan.staging_slots} staging slots of a decode step")
        admitted = {a.expert: a for a in self.policy.step(layer, sel, self.decay, self.hysteresis, len(picked))}
        disk = [e for e in picked if e not in ram]
        targets, staging = [], self.plan.policy_slots
        self._staged = {}
        for e in disk:
            if e in admitted or e in stale:
                targets.append((layer, e, int(slot_of[e])))
            else:
                self._staged[(layer, e)] = staging
                targets.append((layer, e, staging))
                staging += 1
        try:
            self._read(targets)
        except DiskReadError:
            self._undo(layer, admitted, targets)
            raise
        for _, _, slot in targets:
            if slot < self.plan.policy_slots:
                self.stale[slot] = False
        self.reads["ram"] += len(ram)
        self.reads["disk"] += len(disk)
        self.reads["admitted"] += len(admitted)
        return Served(ram, disk)

    def block(self, layer: int, expert: int) -> np.ndarray | None:
        """The expert's block in this tier: its policy slot, or the staging slot the last step read it into; None when
        the tier does not hold it."""
        slot = int(self.policy.slot_of[layer, expert])
        if slot < 0 or self.stale[slot]:
            slot = self._staged.get((layer, expert), -1)
        return None if slot < 0 else self._slot(slot)

    def verify(self) -> list[str]:
        """Every policy slot that is not stale holds its expert's bytes (read again from disk to compare)."""
        problems = []
        E, b = self.store.num_experts, self.plan.block_bytes
        for slot, owner in enumerate(self.policy.owner):
            if self.stale[slot]:
                continue
            layer, expert = int(owner) // E, int(owner) % E
            fresh = np.zeros(b, dtype=np.uint8)
            self.read_into([(layer, expert)], [fresh])
            for _, _, n, off in self.store.block_sources(layer, expert):
                if not np.array_equal(fresh[off:off + n], self._slot(slot)[off:off + n]):
                    problems.append(f"slot {slot} does not hold expert {expert} of {self.store.layer_keys[layer]}")
                    break
        return problems

    def stats(self) -> dict:
        return {"policy_slots": self.plan.policy_slots, "staging_slots": self.plan.staging_slots, "bytes": self.plan.bytes,
                "served": dict(self.reads), "disk": self.reader.counters()}

    # ---- reading

    def _slot(self, slot: int) -> np.ndarray:
        b = self.plan.block_bytes
        return self.arena[slot * b:(slot + 1) * b]

    def _block_reads(self, layer: int, expert: int, dest: np.ndarray) -> list[Read]:
        return [Read(self._file[Path(f)], at, n, dest[off:off + n]) for f, at, n, off in self.store.block_sources(layer, expert)]

    def _read(self, targets: list[tuple[int, int, int]]) -> None:
        self.reader.read([r for layer, e, slot in targets for r in self._block_reads(layer, e, self._slot(slot))])

    def _undo(self, layer: int, admitted: dict, targets: list[tuple[int, int, int]]) -> None:
        """After a failed read: the step's admitted experts leave their slots, which go back to the experts they
        evicted, marked stale (their bytes were overwritten or may have been); staged experts are dropped."""
        E = self.store.num_experts
        for a in admitted.values():
            self.policy.slot_of[layer, a.expert] = -1
            self.policy.slot_of[layer, a.evicted] = a.slot
            self.policy.owner[a.slot] = layer * E + a.evicted
        for _, _, slot in targets:
            if slot < self.plan.policy_slots:
                self.stale[slot] = True
        self._staged = {}
