"""The GPU expert cache's replacement policy: what ``ec_step_kernel`` (``native/ec/expert_cache.cu``) decides at
every decode step, written out in NumPy on the host state it decides on. This is the one readable definition of
the policy; the kernel is its fast copy, ``tests/gpu/test_cache_policy_kernel.py`` holds the two to the same
slots, scores and counters step by step, and ``bench/cache_policy_sim.py`` replays it against other policies.

The state (the same arrays as ``ExpertCache`` keeps on the device):

- ``freq`` float32 [layers, experts]: each expert's slow score, its decayed pick count: a pick ``n`` steps ago
  weighs ``decay ** n`` (``decay`` near 1: how popular the expert is).
- ``recent`` float32 [layers, experts]: the fast score, the same count with ``Recency.decay`` (well below 1: whether
  the expert was picked in the last few steps).
- ``prev`` bool [layers, experts] (uint8 on the device): picked by the first row of the layer's previous decode
  step.
- ``reuse`` float32 [layers, 2]: column 0 the layer's measured reuse lift (below), column 1 the lift popularity
  alone gives (``popularity_lift``, fixed at start). The recency weight of a layer is ``Recency.weight`` times the
  excess of the first over the second, so a layer whose picks recur over tokens (a trained router's) ranks by
  recency as well as popularity, and one whose picks are independent of the past ranks by popularity alone, as the
  static placement does (the best an online policy can do there).
- ``slot_of`` int32 [layers, experts]: the VRAM slot holding the expert, -1 when it is read from the host store;
  ``owner`` int32 [slots]: ``layer * experts + expert`` of the slot's expert.
- ``picks`` int64 [layers, experts] and ``counters`` int64 [layers, C_N]: what the cache reports.

At start the slots are partitioned between layers, once, by the routing profile (``placement``: the slots go to
the (layer, expert) pairs with the largest share of their layer's picks, so a layer with skewed routing gets more
slots), both scores start at the profile's steady state (``warm_scores``, the profile counted as at most
``warm_horizon`` steps of picks), ``prev`` empty and both columns of ``reuse`` at ``popularity_lift``, so decode
starts warm with no recency weight. A step admits an expert of a layer only by evicting one of the same layer, so
each layer keeps its share of the slots.

One decode step of one layer, given the experts its routing picked (``ReferenceCache.step``). Every operation is
one float32 operation, rounded to nearest, in this order (the kernel uses the ``__f*_rn`` intrinsics, so none is
fused):

1. Scores decay: ``f = freq * decay`` and ``r = recent * Recency.decay``.
2. Picks are counted per expert (an expert may be picked by several rows of the step; entries outside
   ``[0, experts)`` are ignored). A picked expert's scores each gain its count in one addition (``f + 3``, not
   ``f + 1 + 1 + 1``, which can round differently); its ``picks`` grow by the count, and so do the hits when it
   was resident at the start of the step.
3. The reuse lift, on the step's first row (the last axis of ``selected``: one stream of a batch, since rows of
   several streams would show popular experts recurring more than one stream's ``popularity_lift`` says): with
   ``n`` the experts of the previous step's first row (``prev``), ``u`` of them in this step's first row and ``m``
   experts in that row in all (integers, each expert once, entries outside ``[0, experts)`` ignored), when
   ``0 < n < experts``: ``lift = u / n - (m - u) / (experts - n)`` (the pick rate of the previous step's experts
   less that of the others) and ``reuse[0] = reuse[0] * keep + (1 - keep) * lift`` (``keep`` is
   ``Recency.keep``; ``1 - keep`` one subtraction); otherwise ``reuse[0]`` stays. Then ``prev`` becomes this
   step's first row's experts.
4. The layer's recency weight ``w = Recency.weight * max(reuse[0] - reuse[1], 0)`` and the score of each expert
   ``s = f + w * r``.
5. Candidates are the picked experts that are not resident; victims the residents that were not picked (an expert
   in use in this step is never evicted). Then, at most ``max_admit`` times: the candidate with the highest
   score ``s`` and the victim with the lowest (ties to the lower expert id, both) are found; the candidate is
   admitted into the victim's slot when ``s[candidate] > hysteresis * s[victim]``, the product rounded to float32
   and the comparison strict, so that one-off picks do not churn the cache. Else, or when either list is empty,
   the step admits nothing more. An admitted expert is no longer a candidate and an evicted one no longer a victim.
6. Counters: picks grow by the number of entries given (out-of-range ones included, as in the kernel), hits by
   the picks of residents, admissions and evictions both by the number admitted, steps by one.

With ``Recency.weight`` 0 (``NO_RECENCY``) the score is the slow one alone (``s = f`` exactly), the policy of the
first cache.

On the host only (the kernel has no such argument), a step may be given ``spare``: residents whose slots are given
up first (the RAM tier's, for the experts the VRAM cache holds: ``ram_tier.TierPolicy.exclusive``). In step 5, while
a victim is spare, the victim is the spare one with the lowest score ``s`` (ties to the lower expert id) and the
candidate takes its slot without the hysteresis test (a spare's score counts as 0; a candidate's is at least its
count); the other victims are taken as above once no spare one is left.

The admitted experts are copied into their slots, in admission order, by the next kernel (``ec_copy_kernel``),
before the layer's experts run, which then read them from VRAM: an admission replaces that step's read of the
expert over the link, it does not add to it. The evicted ones are read from the host store again.
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


def warm_scores(profile: np.ndarray, top_k: int, decay: float, horizon: float | None = None) -> np.ndarray:
    """float32 [layers, experts]: the scores at the steady state of the profile, ``share * top_k / (1 - decay)``
    (what ``f <- f * decay + picks`` converges to when every step picks ``top_k`` experts by the shares), with the
    profile counted as at most ``horizon`` steps of picks: ``share * top_k * horizon`` when ``horizon`` is below
    ``1 / (1 - decay)``. A slow decay then keeps its long memory of the picks served without holding on to a
    shipped profile that the routing does not follow as long (a profile weighs ``1 / (1 - decay)`` steps, 1,000
    at 0.999). None: no cap (the same values, bit for bit, as a horizon at or beyond ``1 / (1 - decay)``)."""
    steady = 1.0 / max(1.0 - decay, 1e-6)
    if horizon is None or horizon >= steady:
        return (shares(profile) * top_k / max(1.0 - decay, 1e-6)).astype(np.float32)
    return (shares(profile) * top_k * float(horizon)).astype(np.float32)


def popularity_lift(profile: np.ndarray, top_k: int) -> np.ndarray:
    """float32 [layers]: the reuse lift (step 3 of the module docstring) that picks independent of the past, by the
    profile's shares, give on average: with ``p = min(top_k * share, 1)`` an expert's chance to be picked in a
    step, ``sum(p^2) / sum(p) - sum(p (1 - p)) / sum(1 - p)``. Popular experts are picked again more often than
    the others without any memory; only a lift above this says that the picks recur."""
    p = np.minimum(shares(profile) * top_k, 1.0)
    hot, total = (p * p).sum(axis=1), p.sum(axis=1)
    rest = profile.shape[1] - total
    return (hot / np.maximum(total, 1e-30) - np.where(rest > 0, (total - hot) / np.maximum(rest, 1e-30), 0.0)).astype(np.float32)


class Recency(NamedTuple):
    """The fast term of the score (module docstring, steps 1, 3 and 4)."""

    decay: float  # of the fast score
    weight: float  # the fast score's weight per unit of reuse lift above popularity's
    keep: float  # of the measured reuse lift, per step


NO_RECENCY = Recency(decay=0.5, weight=0.0, keep=0.99)  # the slow score alone


class Admission(NamedTuple):
    expert: int  # admitted
    slot: int  # the slot it now holds, the evicted expert's
    evicted: int


class ReferenceCache:
    """The cache's decision state on the host, and the kernel's decode step on it (see the module docstring)."""

    def __init__(self, freq: np.ndarray, residents: list[tuple[int, int]], recent: np.ndarray | None = None,
                 popularity: np.ndarray | None = None):
        """
        :param freq: float [layers, experts] starting slow scores (rounded to float32, as the device holds them).
        :param residents: (layer, expert) of each slot's expert, slot 0 first; every slot is filled.
        :param recent: float [layers, experts] starting fast scores (None: zeros).
        :param popularity: float [layers] ``popularity_lift``, both columns of ``reuse`` at start (None: zeros).
        :raise ValueError: a pair outside ``freq``'s shape, or one expert in two slots.
        """
        self.freq = np.array(freq, dtype=np.float32)
        layers, experts = self.freq.shape
        self.num_experts = experts
        self.recent = np.zeros((layers, experts), dtype=np.float32) if recent is None else np.array(recent, dtype=np.float32)
        self.prev = np.zeros((layers, experts), dtype=bool)
        self.reuse = np.zeros((layers, 2), dtype=np.float32)
        if popularity is not None:
            self.reuse[:] = np.asarray(popularity, dtype=np.float32)[:, None]
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
    def warm(cls, profile: np.ndarray, slots: int, top_k: int, decay: float, recency: Recency = NO_RECENCY,
             warm_horizon: float | None = None) -> ReferenceCache:
        """The state ``ExpertCache`` starts from: ``placement`` fills the slots (at most every expert), the scores
        are ``warm_scores`` (of ``decay`` and of ``recency.decay``, both capped at ``warm_horizon`` steps),
        ``reuse`` is ``popularity_lift``.

        :param profile: float [layers, experts] picks per expert (zeros: no profile, a cold start).
        """
        return cls(warm_scores(profile, top_k, decay, warm_horizon), placement(profile, slots),
                   warm_scores(profile, top_k, recency.decay, warm_horizon), popularity_lift(profile, top_k))

    @classmethod
    def of_layer(cls, freq, recent, prev, reuse, slot_of, slots: int) -> ReferenceCache:
        """One layer's state as the device holds it (host copies of its rows: ``freq``, ``recent`` float32 [experts],
        ``prev`` bool [experts], ``reuse`` float32 [2], ``slot_of`` int [experts] of ``slots`` slots in all), as
        layer 0 of a state whose :meth:`step` makes the device's next step's decisions on it: what the host can know
        of the device's step before it runs (``tiered.TieredHome``'s write-back)."""
        state = cls(np.asarray(freq, dtype=np.float32)[None], [], np.asarray(recent, dtype=np.float32)[None])
        state.prev[0] = np.asarray(prev, dtype=bool)
        state.reuse[0] = np.asarray(reuse, dtype=np.float32)
        state.slot_of[0] = np.asarray(slot_of, dtype=np.int32)
        state.owner = np.full(max(slots, 1), -1, dtype=np.int32)
        resident = np.flatnonzero(state.slot_of[0] >= 0)
        state.owner[state.slot_of[0, resident]] = resident
        return state

    def step(self, layer: int, selected, decay: float, hysteresis: float, max_admit: int,
             recency: Recency = NO_RECENCY, spare: np.ndarray | None = None) -> list[Admission]:
        """One decode step of one layer, ``ec_step_kernel``'s: count, score, admit. Updates the state and returns
        the admissions in order (the kernel's copy jobs).

        :param selected: int, any shape: the experts the routing picked, one entry per (row, pick); the last axis
            is a row (the first row measures the reuse lift).
        :param decay, hysteresis, recency: rounded to float32, as the kernel takes them.
        :param spare: bool [experts], the residents whose slots are given up first (module docstring; host only);
            None: none.
        """
        experts = self.num_experts
        rows = np.asarray(selected, dtype=np.int64)
        sel = rows.reshape(-1)
        count = np.bincount(sel[(sel >= 0) & (sel < experts)], minlength=experts)
        first = sel[: rows.shape[-1] if rows.ndim else 1]
        first_row = np.bincount(first[(first >= 0) & (first < experts)], minlength=experts) > 0
        picked = count > 0
        slot_of = self.slot_of[layer]
        resident = slot_of >= 0
        f = self.freq[layer] * np.float32(decay)
        r = self.recent[layer] * np.float32(recency.decay)
        added = count[picked].astype(np.float32)
        f[picked] += added
        r[picked] += added
        self.picks[layer] += count
        hits = int(count[resident].sum())
        self._measure_reuse(layer, first_row, np.float32(recency.keep))
        s = f + self._recency_weight(layer, recency.weight) * r
        candidate = picked & ~resident
        victim = ~picked & resident
        given_up = victim & (np.zeros(experts, dtype=bool) if spare is None else np.asarray(spare, dtype=bool))
        admitted: list[Admission] = []
        for _ in range(max_admit):
            if not candidate.any() or not victim.any():
                break
            c = _lowest_arg(s, candidate, np.argmax)
            if given_up.any():  # a spare slot: its score counts as 0, which every candidate beats
                v = _lowest_arg(s, given_up, np.argmin)
            else:
                v = _lowest_arg(s, victim, np.argmin)
                if not s[c] > np.float32(hysteresis) * s[v]:
                    break
            slot = int(slot_of[v])
            slot_of[v], slot_of[c] = -1, slot
            candidate[c] = victim[v] = given_up[v] = False
            self.owner[slot] = layer * experts + c
            admitted.append(Admission(c, slot, v))
        self.freq[layer] = f
        self.recent[layer] = r
        counters = self.counters[layer]
        counters[C_PICKS] += sel.size
        counters[C_HITS] += hits
        counters[C_ADMITS] += len(admitted)
        counters[C_EVICTS] += len(admitted)
        counters[C_STEPS] += 1
        return admitted

    def scores(self, layer: int, weight: float) -> np.ndarray:
        """float32 [experts]: the layer's scores as the last :meth:`step` ranked them (slow + weighted fast), from the
        state it left; ``weight``: the recency weight it was given."""
        return self.freq[layer] + self._recency_weight(layer, weight) * self.recent[layer]

    def _recency_weight(self, layer: int, weight: float) -> np.float32:
        """Step 4's weight of the fast score: ``weight`` per unit of the layer's reuse lift above popularity's."""
        excess = self.reuse[layer, 0] - self.reuse[layer, 1]
        return np.float32(weight) * (excess if excess > 0 else np.float32(0))

    def _measure_reuse(self, layer: int, first_row: np.ndarray, keep: np.float32) -> None:
        """Step 3: the previous step's experts' pick rate less the others', on the first row, into the layer's
        average."""
        prev = self.prev[layer]
        n, again, now = int(prev.sum()), int((first_row & prev).sum()), int(first_row.sum())
        if 0 < n < self.num_experts:
            lift = np.float32(again) / np.float32(n) - np.float32(now - again) / np.float32(self.num_experts - n)
            self.reuse[layer, 0] = self.reuse[layer, 0] * keep + (np.float32(1) - keep) * lift
        prev[:] = first_row

    def residents(self, layer: int) -> list[int]:
        """The experts of ``layer`` in a slot, by expert id."""
        return [int(e) for e in np.flatnonzero(self.slot_of[layer] >= 0)]


def _lowest_arg(values: np.ndarray, ok: np.ndarray, arg) -> int:
    """The index of the extreme (``np.argmax``/``np.argmin``) of ``values`` where ``ok``; ties to the lowest index,
    like the kernel's block reduction (NumPy returns the first extreme, and the indices are in ascending order)."""
    where = np.flatnonzero(ok)
    return int(where[arg(values[where])])
