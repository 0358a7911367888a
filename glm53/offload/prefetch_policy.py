"""Predictive prefetch of routed experts: what the device is to do before each MoE layer, written out in NumPy.
This is the one readable definition (as ``cache_policy`` is the cache's); the device code (``native/ec/prefetch.cuh``) is its
fast copy and ``bench/prefetch_sim.py`` replays it on routing traces.

Before layer ``l`` runs its experts, a prediction of its picks is at hand (layer ``l``'s router scored on a hidden
state that exists earlier, e.g. the input of layer ``l``'s attention). The predicted experts that are not resident
in the cache are copied by the copy engine into a small pool of prefetch slots while the attention runs, when the
host link is otherwise idle; when the layer's routing then picks one of them, it is read from VRAM like a hit.

1. Prediction (``prediction``): GLM routing on the predicted scores, widened by ``extra``: per row the
   top-``(top_k + extra)`` experts of ``sigmoid(logit) + bias`` (the correction bias changes the selection only),
   best first, ties to the lower expert id, with those scores (float32).
2. Pool fill (``fill_pool``): the predicted experts not resident in the cache at the start of the layer's step whose
   score clears ``min_score`` (float32 ``score >= min_score``; a prediction without scores, such as the lead's or the
   oracle's, clears it), ordered hottest first, coldest last: by the number of rows that predict the expert (more
   first), then by its best position in a row's list (nearer the top first), then by expert id (lower first).
   Integer keys and one float32 comparison, so the device's order is the same bit for bit. The first ``min(pool_slots,
   copies)`` are copied, ``copies`` being the layer's link budget (``budget_copies``).

   Why a threshold: a copy is paid for in link time whether or not the routing then picks the expert, and the
   layer waits for its copies. On the H200 host one expert's copy (about 170 us) is longer than the window between
   two MoE layers (132 us), so even the first copy runs past the window by ``copy - window`` and that overrun is a
   stall; it saves one miss's link time when it is used. It pays when ``chance x miss time > overrun``, and the
   chance is the predictor's measured precision at that score (``bench.prefetch_sim --calibrate``: precision by
   score and by rank on the routing twins, and the threshold where the break-even holds; ``GLM53_PREFETCH_MIN_SCORE``).

   Why this budget: ``budget_copies`` issues the copies that START inside the window, ``ceil(window / copy time)``:
   those that end in it cost nothing, the one that straddles its end costs its overrun (what the threshold weighs),
   and one more would run wholly past it, a stall of a full copy against a saving of at most one miss's link time,
   which the same link carries no faster (the copy and the zero-copy read share it): never a gain. The window and
   the copy rate are measured on the running engine (``prefetch.CopyBudget``).
3. The layer's step (``PrefetchReplay.step``): the true picks that are resident at the start of the step are
   hits, those in the pool ``prefetch_hits``, the rest misses; a copied expert that no row picks is wasted. Then
   the cache's own step, unchanged (``ReferenceCache.step``) on the same true picks: a prefetched expert that is
   used IS a pick for the cache's scores, since the routing picked it whatever the pool held. So the cache's state,
   hits and admissions are the same as without prefetch (for the same number of cache slots): prefetch only turns
   misses into prefetch hits. When the cache admits an expert that is in the pool, the admission copies it from the
   pool slot (VRAM to VRAM), not over the link.
4. The pool is the layer's for that one step: the next layer's prefetch overwrites it, so nothing in it carries
   over to the next step (a pool that did would be a second cache).

Slots: the pool and the cache share one VRAM budget of expert-sized slots (``Split``). One pool serves every layer
in turn (``buffers=1``: layer ``l``'s copies start once layer ``l - 1``'s experts have read the pool); two let
the copies start a layer earlier; ``buffers=layers`` is a pool per layer.

Link bytes of a step: a missed expert is read once (zero-copy, or copied in by the cache's admission), a copied
expert once by the prefetch; ``miss_experts`` counts the distinct missed experts of each layer and step (several
rows that pick the same expert read it once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .cache_policy import NO_RECENCY, Recency, ReferenceCache

# counters per layer, all in pick units except the *_EXPERTS ones (distinct experts per step)
(P_PICKS, P_HITS, P_PREFETCH_HITS, P_MISSES, P_COPIED_EXPERTS, P_WASTED_EXPERTS, P_MISS_EXPERTS,
 P_FROM_POOL, P_STEPS, P_N) = range(10)


def prediction(logits, bias, top_k: int, extra: int) -> tuple[np.ndarray, np.ndarray]:
    """GLM routing's selection, widened: per row the top-``(top_k + extra)`` experts of ``sigmoid(logits) + bias``,
    best first, ties to the lower expert id, and their scores.

    :param logits: float [rows, experts] (or [experts]) router logits of the predicted layer.
    :param bias: float [experts] the layer's ``e_score_correction_bias`` (selection only).
    :return: (int64 [rows, n] experts, float32 [rows, n] their scores), ``n = min(top_k + extra, experts)``.
    :raise ValueError: ``extra`` or ``top_k`` negative, or a bias of the wrong length.
    """
    z = np.atleast_2d(np.asarray(logits, dtype=np.float32))
    b = np.asarray(bias, dtype=np.float32).reshape(-1)
    if top_k < 0 or extra < 0 or b.shape[0] != z.shape[1]:
        raise ValueError(f"top_k {top_k}, extra {extra}, bias of {b.shape[0]} for {z.shape[1]} experts")
    score = (np.float32(1.0) / (np.float32(1.0) + np.exp(-z))) + b  # float32, as the device computes it
    n = min(top_k + extra, z.shape[1])
    picks = np.argsort(-score, axis=1, kind="stable")[:, :n].astype(np.int64)  # stable: ties keep the lower id first
    return picks, np.take_along_axis(score, picks, axis=1)


def predicted_picks(logits, bias, top_k: int, extra: int) -> np.ndarray:
    """``prediction``'s experts alone: int64 [rows, min(top_k + extra, experts)]."""
    return prediction(logits, bias, top_k, extra)[0]


def budget_experts(budget_bytes: int, expert_bytes: int) -> int:
    """How many whole experts the link carries within ``budget_bytes``."""
    return max(0, int(budget_bytes) // max(int(expert_bytes), 1))


def budget_copies(window_s: float, copy_gbs: float, expert_bytes: int) -> int:
    """The copies a layer may issue: those that start within its window of ``window_s`` seconds when each takes
    ``expert_bytes`` at ``copy_gbs`` GB/s, ``ceil(window / copy time)`` (the module docstring says why); 0 for no
    window."""
    if not window_s > 0 or not copy_gbs > 0:
        return 0
    return math.ceil(window_s * copy_gbs * 1e9 / max(int(expert_bytes), 1))


def fill_pool(predicted, resident: np.ndarray, slots: int, scores=None, min_score: float | None = None) -> list[int]:
    """The experts copied into the pool, in copy order: the predicted experts not in ``resident`` whose score clears
    ``min_score``, by rows predicting them (more first), best position in a row (lower first), expert id (lower
    first); at most ``slots``.

    :param predicted: int [rows, n] or [n]: each row's predicted experts, best first; entries outside
        ``[0, experts)`` are ignored, a repeat within a row counts once (its best position that clears).
    :param resident: bool [experts]: in a cache slot at the start of the step.
    :param slots: how many may be copied (the pool's slots, already limited by the link budget).
    :param scores: float [rows, n] each entry's predicted score, or None (every entry clears).
    :param min_score: an entry counts when float32 ``score >= min_score`` (None: no threshold).
    """
    experts = resident.shape[0]
    pred = np.atleast_2d(np.asarray(predicted, dtype=np.int64))
    clears = np.ones(pred.shape, dtype=bool)
    if scores is not None and min_score is not None:
        clears = np.atleast_2d(np.asarray(scores, dtype=np.float32)) >= np.float32(min_score)
    rows = np.zeros(experts, dtype=np.int64)
    best = np.full(experts, pred.shape[1], dtype=np.int64)
    for row, row_clears in zip(pred, clears):
        seen = np.zeros(experts, dtype=bool)
        for pos, e in enumerate(row):
            if 0 <= e < experts and row_clears[pos] and not seen[e]:
                seen[e] = True
                rows[e] += 1
                best[e] = min(best[e], pos)
    cand = np.flatnonzero((rows > 0) & ~resident)
    order = np.lexsort((cand, best[cand], -rows[cand]))  # last key first: rows, then position, then id
    return [int(e) for e in cand[order][: max(0, slots)]]


@dataclass(frozen=True)
class Split:
    """One VRAM budget of ``total`` expert-sized slots shared by the cache and the prefetch pool(s).

    ``pool``: slots each layer's prefetch may fill; ``buffers``: how many pools exist at once (1: one pool every
    layer uses in turn; the model's MoE layer count: a pool per layer). The cache gets the rest.
    """

    total: int
    pool: int = 0
    buffers: int = 1

    def __post_init__(self):
        if self.total < 0 or self.pool < 0 or self.buffers < 1 or self.pool_slots > self.total:
            raise ValueError(f"bad slot split {self}: the pools' {self.pool_slots} slots must fit in {self.total}")

    @property
    def pool_slots(self) -> int:
        return self.pool * self.buffers

    @property
    def cache_slots(self) -> int:
        return self.total - self.pool_slots


class PrefetchReplay:
    """The cache and the prefetch pool over a routing trace, one layer step at a time (see the module docstring)."""

    def __init__(self, cache: ReferenceCache, pool: int, budget_bytes: int, expert_bytes: int,
                 decay: float, hysteresis: float, max_admit: int, recency: Recency = NO_RECENCY,
                 min_score: float | None = None):
        """
        :param cache: the cache's state, stepped in place.
        :param pool: the pool's slots per layer step.
        :param budget_bytes: link bytes per layer that arrive within the attention's time.
        :param expert_bytes: one expert's bytes (a slot's size).
        :param decay, hysteresis, max_admit, recency: the cache's policy (``glm53.offload.cache.Policy``'s fields
            and ``recency``).
        :param min_score: the score a scored prediction's entry must clear to be copied (``fill_pool``).
        """
        self.cache = cache
        self.min_score = min_score
        self.copies = min(max(pool, 0), budget_experts(budget_bytes, expert_bytes))
        self.expert_bytes = int(expert_bytes)
        self.policy = (decay, hysteresis, max_admit, recency)
        self.counters = np.zeros((cache.freq.shape[0], P_N), dtype=np.int64)

    def step(self, layer: int, selected, predicted, scores=None) -> list[int]:
        """One layer's decode step: fill the pool from ``predicted``, count the true picks ``selected`` against the
        residents and the pool, then the cache's own step on ``selected``. Returns the experts copied.

        :param selected: int, any shape: the experts the routing picked, one entry per (row, pick); entries
            outside ``[0, experts)`` are ignored.
        :param predicted: int [rows, n]: each row's predicted experts, best first (``prediction``), or None.
        :param scores: float [rows, n] their scores, or None (no threshold applies).
        """
        experts = self.cache.num_experts
        sel = np.asarray(selected, dtype=np.int64).reshape(-1)
        count = np.bincount(sel[(sel >= 0) & (sel < experts)], minlength=experts)
        resident = self.cache.slot_of[layer] >= 0
        copied = (fill_pool(predicted, resident, self.copies, scores, self.min_score)
                  if predicted is not None and self.copies else [])
        in_pool = np.zeros(experts, dtype=bool)
        in_pool[copied] = True
        picked = count > 0
        c = self.counters[layer]
        c[P_PICKS] += int(count.sum())
        c[P_HITS] += int(count[resident].sum())
        c[P_PREFETCH_HITS] += int(count[in_pool].sum())  # the pool holds no resident
        c[P_MISSES] += int(count[~resident & ~in_pool].sum())
        c[P_COPIED_EXPERTS] += len(copied)
        c[P_WASTED_EXPERTS] += int((in_pool & ~picked).sum())
        c[P_MISS_EXPERTS] += int((picked & ~resident & ~in_pool).sum())
        c[P_STEPS] += 1
        admitted = self.cache.step(layer, sel, *self.policy)
        c[P_FROM_POOL] += sum(bool(in_pool[a.expert]) for a in admitted)
        return copied

    def link_bytes(self) -> tuple[int, int]:
        """(miss bytes, prefetch bytes) over the replay, all layers."""
        total = self.counters.sum(axis=0)
        return int(total[P_MISS_EXPERTS]) * self.expert_bytes, int(total[P_COPIED_EXPERTS]) * self.expert_bytes


def replay(trace, profile: np.ndarray, split: Split, predict, budget_bytes: int, expert_bytes: int,
           decay: float, hysteresis: float, max_admit: int, recency: Recency = NO_RECENCY,
           min_score: float | None = None, warm_horizon: float | None = None) -> PrefetchReplay:
    """Replay a routing trace step by step, every layer in order, from the cache's warm start
    (``ReferenceCache.warm`` with the split's cache slots and ``warm_horizon``) and a pool of ``split.pool`` slots.

    :param trace: int [steps, layers, ..., top_k], or a sequence of int [layers, rows, top_k] (steps of different
        row counts): each layer's true picks per step.
    :param profile: float [layers, experts] the routing profile the cache starts from.
    :param predict: ``predict(step, layer) -> int [rows, n]``, the prediction for that layer step, or a tuple of it
        and its float [rows, n] scores (or None for no prefetch); called just before the layer's step, as the device
        predicts before the layer runs.
    :param min_score: the threshold on scored predictions (``fill_pool``).
    """
    top_k = np.asarray(trace[0]).shape[-1]
    cache = ReferenceCache.warm(profile, split.cache_slots, top_k, decay, recency, warm_horizon)
    run = PrefetchReplay(cache, split.pool, budget_bytes, expert_bytes, decay, hysteresis, max_admit, recency, min_score)
    for t, step in enumerate(trace):
        for layer, selected in enumerate(step):
            made = predict(t, layer) if predict is not None and run.copies else None
            predicted, scores = made if isinstance(made, tuple) else (made, None)
            run.step(layer, selected, predicted, scores)
    return run
