"""The GPU expert cache's replacement policy: what ``ec_step_kernel`` (``native/ec/expert_cache.cu``) decides at
every decode step, written out in NumPy on the host state it decides on. This is the one readable definition of
the policy; the kernel is its fast copy, ``tests/gpu/test_cache_policy_kernel.py`` holds the two to the same
slots, scores and counters step by step, and ``bench/cache_policy_sim.py`` replays it against other policies.

The state (the same arrays as ``ExpertCache`` keeps on the device):

- ``freq`` float32 [layers, experts]: each expert's decayed pick count, the replacement score. One score for
  frequency and recency: a pick ``n`` steps ago weighs ``decay ** n``.
- ``slot_of`` int32 [layers, experts]: the VRAM slot holding the expert, -1 when it is read from the host store;
  ``owner`` int32 [slots]: ``layer * experts + expert`` of the slot's expert.
- ``picks`` int64 [layers, experts] and ``counters`` int64 [layers, C_N]: what the cache reports.

At start the slots are partitioned between layers, once, by the routing profile (``placement``: the slots go to
the (layer, expert) pairs with the largest share of their layer's picks, so a layer with skewed routing gets more
slots), and the scores start at the profile's steady state (``warm_scores``), so decode starts warm. A step
admits an expert of a layer only by evicting one of the same layer, so each layer keeps its share of the slots.

One decode step of one layer, given the experts its routing picked (``ReferenceCache.step``):

1. Every score of the layer decays: ``f = freq * decay``, one float32 multiplication.
2. Picks are counted per expert (an expert may be picked by several rows of the step; entries outside
   ``[0, experts)`` are ignored). A picked expert's score gains its count in one float32 addition
   (``f + 3``, not ``f + 1 + 1 + 1``, which can round differently); its ``picks`` grow by the count, and so do
   the hits when it was resident at the start of the step.
3. Candidates are the picked experts that are not resident; victims the residents that were not picked (an expert
   in use in this step is never evicted). Then, at most ``max_admit`` times: the candidate with the highest
   score and the victim with the lowest (ties to the lower expert id, both) are found; the candidate is admitted
   into the victim's slot when ``f[candidate] > hysteresis * f[victim]``, the product rounded to float32 and the
   comparison strict, so that one-off picks do not churn the cache. Else, or when either list is empty, the step
   admits nothing more. An admitted expert is no longer a candidate and an evicted one no longer a victim.
4. Counters: picks grow by the number of entries given (out-of-range ones included, as in the kernel), hits by
   the picks of residents, admissions and evictions both by the number admitted, steps by one.

The admitted experts are copied into their slots, in admission order, by the next kernel (``ec_copy_kernel``),
before the layer's experts run; the evicted ones are read from the host store again.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

C_PICKS, C_HITS, C_ADMITS, C_EVICTS, C_STEPS, C_N = 0, 1, 2, 3, 4, 8  # counters per layer (the kernel's enum)


def shares(profile: np.ndarray) -> np.ndarray:
    """Each expert's share of its layer's picks (uniform for a layer without picks)."""
    totals = profile.sum(axis=1, keepdims=True)
    return np.where(totals > 0, profile / np.maximum(totals, 1e-30), 1.0 / profile.shape[1])


def placement(profile: np.ndarray, slots: int) -> list[tuple[int, int]]:
    """The (layer, expert) pairs the slots start with, most valuable first: the ``slots`` pairs with the largest
    share of their layer's picks (every layer sees the same number of picks per token, so shares compare across
    layers; a layer with skewed routing gets more slots). Ties go to the lower expert id, then the lower layer,
    so without a profile the slots spread evenly over the layers."""
    num_experts = profile.shape[1]
    order = np.lexsort((np.arange(profile.size) // num_experts, np.arange(profile.size) % num_experts, -shares(profile).reshape(-1)))
    return [(int(i) // num_experts, int(i) % num_experts) for i in order[: max(0, min(slots, profile.size))]]


def warm_scores(profile: np.ndarray, top_k: int, decay: float) -> np.ndarray:
    """float32 [layers, experts]: the scores at the steady state of the profile, ``share * top_k / (1 - decay)``
    (what ``f <- f * decay + picks`` converges to when every step picks ``top_k`` experts by the shares)."""
    return (shares(profile) * top_k / max(1.0 - decay, 1e-6)).astype(np.float32)


class Admission(NamedTuple):
    expert: int  # admitted
    slot: int  # the slot it now holds, the evicted expert's
    evicted: int


class ReferenceCache:
    """The cache's decision state on the host, and the kernel's decode step on it (see the module docstring)."""

    def __init__(self, freq: np.ndarray, residents: list[tuple[int, int]]):
        """
        :param freq: float [layers, experts] starting scores (rounded to float32, as the device holds them).
        :param residents: (layer, expert) of each slot's expert, slot 0 first; every slot is filled.
        :raise ValueError: a pair outside ``freq``'s shape, or one expert in two slots.
        """
        self.freq = np.array(freq, dtype=np.float32)
        layers, experts = self.freq.shape
        self.num_experts = experts
        self.slot_of = np.full((layers, experts), -1, dtype=np.int32)
        self.owner = np.full(len(residents), -1, dtype=np.int32)
        for slot, (layer, expert) in enumerate(residents):
            if not (0 <= layer < layers and 0 <= expert < experts) or self.slot_of[layer, expert] >= 0:
                raise ValueError(f"slot {slot}: (layer {layer}, expert {expert}) is outside {layers} x {experts} or already in a slot")
            self.slot_of[layer, expert] = slot
            self.owner[slot] = layer * experts + expert
        self.picks = np.zeros((layers, experts), dtype=np.int64)
        self.counters = np.zeros((layers, C_N), dtype=np.int64)

    @classmethod
    def warm(cls, profile: np.ndarray, slots: int, top_k: int, decay: float) -> ReferenceCache:
        """The state ``ExpertCache`` starts from: ``placement`` fills the slots (at most every expert), the scores
        are ``warm_scores``.

        :param profile: float [layers, experts] picks per expert (zeros: no profile, a cold start).
        """
        return cls(warm_scores(profile, top_k, decay), placement(profile, slots))

    def step(self, layer: int, selected, decay: float, hysteresis: float, max_admit: int) -> list[Admission]:
        """One decode step of one layer, ``ec_step_kernel``'s: count, score, admit. Updates the state and returns
        the admissions in order (the kernel's copy jobs).

        :param selected: int, any shape: the experts the routing picked, one entry per (row, pick).
        :param decay, hysteresis: rounded to float32, as the kernel takes them.
        """
        experts = self.num_experts
        sel = np.asarray(selected, dtype=np.int64).reshape(-1)
        count = np.bincount(sel[(sel >= 0) & (sel < experts)], minlength=experts)
        picked = count > 0
        slot_of = self.slot_of[layer]
        resident = slot_of >= 0
        f = self.freq[layer] * np.float32(decay)
        f[picked] += count[picked].astype(np.float32)
        self.picks[layer] += count
        hits = int(count[resident].sum())
        candidate = picked & ~resident
        victim = ~picked & resident
        admitted: list[Admission] = []
        for _ in range(max_admit):
            if not candidate.any() or not victim.any():
                break
            c = _lowest_arg(f, candidate, np.argmax)
            v = _lowest_arg(f, victim, np.argmin)
            if not f[c] > np.float32(hysteresis) * f[v]:
                break
            slot = int(slot_of[v])
            slot_of[v], slot_of[c] = -1, slot
            candidate[c] = victim[v] = False
            self.owner[slot] = layer * experts + c
            admitted.append(Admission(c, slot, v))
        self.freq[layer] = f
        counters = self.counters[layer]
        counters[C_PICKS] += sel.size
        counters[C_HITS] += hits
        counters[C_ADMITS] += len(admitted)
        counters[C_EVICTS] += len(admitted)
        counters[C_STEPS] += 1
        return admitted

    def residents(self, layer: int) -> list[int]:
        """The experts of ``layer`` in a slot, by expert id."""
        return [int(e) for e in np.flatnonzero(self.slot_of[layer] >= 0)]


def _lowest_arg(values: np.ndarray, ok: np.ndarray, arg) -> int:
    """The index of the extreme (``np.argmax``/``np.argmin``) of ``values`` where ``ok``; ties to the lowest index,
    like the kernel's block reduction (NumPy returns the first extreme, and the indices are in ascending order)."""
    where = np.flatnonzero(ok)
    return int(where[arg(values[where])])
