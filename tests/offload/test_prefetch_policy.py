"""Predictive prefetch (glm53.offload.prefetch_policy): steps worked out by hand on 8 experts and top-2, and the
invariants of random routing traces against the plain cache replay."""

from __future__ import annotations

import numpy as np
import pytest

from glm53.offload.cache_policy import C_HITS, C_PICKS, ReferenceCache
from glm53.offload.prefetch_policy import (
    P_COPIED_EXPERTS,
    P_FROM_POOL,
    P_HITS,
    P_MISS_EXPERTS,
    P_MISSES,
    P_PICKS,
    P_PREFETCH_HITS,
    P_STEPS,
    P_WASTED_EXPERTS,
    PrefetchReplay,
    Split,
    budget_copies,
    budget_experts,
    fill_pool,
    predicted_picks,
    prediction,
    replay,
)
from tests.offload.test_cache_policy import picks_profile, popularity, routing_trace

MB = 1_000_000
KEEP = (0.5, 1e9, 0)  # decay, hysteresis, max_admit: the cache admits nothing, so residents stay put


def _eight(residents=(0, 1), pool=1, budget=10 * MB, policy=KEEP) -> PrefetchReplay:
    """One layer of 8 experts, the residents hot, 1 MB experts."""
    freq = np.zeros((1, 8))
    freq[0, list(residents)] = 10.0
    return PrefetchReplay(ReferenceCache(freq, [(0, e) for e in residents]), pool, budget, MB, *policy)


def _counts(run: PrefetchReplay, *which) -> tuple:
    return tuple(int(run.counters[0, w]) for w in which)


# ---- the prediction


def test_prediction_ranks_sigmoid_scores_plus_the_bias_and_breaks_ties_to_the_lower_id():
    # sigmoid(2) = 0.88 < sigmoid(0) + 0.5: the bias is added to the sigmoid, not to the logit
    assert predicted_picks([2.0, 0.0, -1.0], [0.0, 0.5, 0.0], top_k=1, extra=0).tolist() == [[1]]
    assert predicted_picks([[0.0] * 8], np.zeros(8), top_k=2, extra=2).tolist() == [[0, 1, 2, 3]]
    two_rows = predicted_picks([[0, 3, 1, 3, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 5]], np.zeros(8), top_k=2, extra=1)
    assert two_rows.tolist() == [[1, 3, 2], [0, 7, 1]]
    assert predicted_picks(np.zeros((1, 4)), np.zeros(4), top_k=3, extra=5).shape == (1, 4)  # at most every expert
    with pytest.raises(ValueError):
        predicted_picks(np.zeros((1, 4)), np.zeros(3), top_k=2, extra=0)


def test_the_pool_takes_non_residents_by_rows_then_best_position_then_id():
    resident = np.zeros(8, dtype=bool)
    resident[0] = True
    # 1: two rows, best position 0; 3: one row, position 0; 4: one row, position 1; 2: position 2; 0 is resident
    assert fill_pool([[3, 1, 2], [1, 4, 0]], resident, 8) == [1, 3, 4, 2]
    assert fill_pool([[3, 1, 2], [1, 4, 0]], resident, 2) == [1, 3]
    assert fill_pool([[6, 5], [5, 6]], resident, 1) == [5]  # same rows, same best position: the lower id
    assert fill_pool([[9, -1, 2, 2]], resident, 4) == [2]  # out of range ignored, a repeat counts once
    assert fill_pool([[0]], resident, 4) == [] and fill_pool([[1, 2]], resident, 0) == []


def test_the_prediction_carries_each_entrys_float32_score():
    picks, scores = prediction([[2.0, 0.0, -1.0]], [0.0, 0.5, 0.0], top_k=1, extra=1)
    assert picks.tolist() == [[1, 0]] and scores.dtype == np.float32
    want = np.float32(1) / (np.float32(1) + np.exp(-np.float32([0.0, 2.0]))) + np.float32([0.5, 0.0])
    assert np.array_equal(scores[0], want)


# ---- the threshold on the predicted score


def test_entries_below_the_threshold_are_ignored_and_the_threshold_itself_clears():
    resident = np.zeros(8, dtype=bool)
    predicted = [[3, 1, 2, 4]]
    scores = [[0.9, 0.5, 0.7, 0.69]]
    assert fill_pool(predicted, resident, 8, scores, 0.7) == [3, 2]  # >=: 0.7 clears 0.7, 0.69 and 0.5 do not
    assert fill_pool(predicted, resident, 8, scores, None) == [3, 1, 2, 4]  # no threshold
    assert fill_pool(predicted, resident, 8, None, 0.7) == [3, 1, 2, 4]  # no scores (the lead, the oracle)
    assert fill_pool(predicted, resident, 8, scores, 2.0) == []


def test_the_threshold_compares_in_float32_and_a_nan_never_clears():
    resident = np.zeros(8, dtype=bool)
    just_below = np.nextafter(np.float32(0.8), np.float32(0.0))
    # 0.8 in float64 is above float32(0.8) and 0.80000001 rounds to it: the comparison is the device's, in float32
    assert fill_pool([[1, 2, 3]], resident, 8, [[0.8, 0.80000001, just_below]], 0.8) == [1, 2]
    assert fill_pool([[1, 2]], resident, 8, [[np.nan, 0.9]], 0.0) == [2]


def test_a_repeat_counts_at_its_best_position_that_clears_and_rows_count_only_clearing_entries():
    resident = np.zeros(8, dtype=bool)
    # 5 at position 0 does not clear; its repeat at position 2 does: 5 ranks by position 2, after 6 (position 1)
    assert fill_pool([[5, 6, 5]], resident, 8, [[0.1, 0.9, 0.9]], 0.5) == [6, 5]
    # 2 is predicted by both rows but clears in one, 7 clears in both: 7 first, by rows
    assert fill_pool([[2, 7], [7, 2]], resident, 8, [[0.9, 0.9], [0.9, 0.1]], 0.5) == [7, 2]
    assert fill_pool([[2, 7], [7, 2]], resident, 8, [[0.9, 0.9], [0.9, 0.9]], 0.5) == [2, 7]  # two rows each: id
    assert fill_pool([[2, 7], [7, 3]], resident, 8, [[0.1, 0.9], [0.9, 0.9]], 0.5) == [7, 3]


def test_a_replay_with_scores_copies_only_what_clears():
    run = _eight(residents=(0, 1), pool=2)
    run.min_score = 0.5
    assert run.step(0, [2, 3], [[3, 2]], [[0.4, 0.6]]) == [2]
    assert _counts(run, P_PREFETCH_HITS, P_MISSES, P_COPIED_EXPERTS) == (1, 1, 1)


def test_the_copy_budget_issues_the_copies_that_start_inside_the_window():
    # 1 MB at 10 GB/s is 100 us a copy: 99 us of window start one copy, 100 us still one, 101 us two
    assert [budget_copies(w * 1e-6, 10.0, MB) for w in (0, 1, 99, 100, 101, 250)] == [0, 1, 1, 1, 2, 3]
    assert budget_copies(1e-3, 0.0, MB) == 0 and budget_copies(float("nan"), 10.0, MB) == 0


def test_the_link_budget_counts_whole_experts():
    assert [budget_experts(b, MB) for b in (0, MB - 1, MB, int(2.5 * MB))] == [0, 0, 1, 2]
    assert _eight(pool=4, budget=int(2.5 * MB)).copies == 2  # a pool wider than the budget is never filled
    assert _eight(pool=1, budget=100 * MB).copies == 1


# ---- steps worked out by hand


def test_a_prefetched_pick_is_a_prefetch_hit_and_an_unpicked_copy_is_wasted():
    run = _eight(residents=(0, 1), pool=1)
    assert run.step(0, [2, 3], [[3, 2]]) == [3]  # 3 ranks first; one slot
    assert _counts(run, P_PICKS, P_HITS, P_PREFETCH_HITS, P_MISSES, P_WASTED_EXPERTS) == (2, 0, 1, 1, 0)
    assert run.step(0, [0, 2], [[5, 0]]) == [5]  # 0 is resident, so 5 is copied, and not picked
    assert _counts(run, P_PICKS, P_HITS, P_PREFETCH_HITS, P_MISSES, P_WASTED_EXPERTS) == (4, 1, 1, 2, 1)
    assert _counts(run, P_COPIED_EXPERTS, P_MISS_EXPERTS, P_STEPS) == (2, 2, 2)
    assert run.link_bytes() == (2 * MB, 2 * MB)


def test_rows_picking_one_expert_are_prefetch_hits_each_but_one_copy():
    run = _eight(residents=(0, 1), pool=2)
    assert run.step(0, [[2, 3], [2, 4]], [[2, 5], [4, 2]]) == [2, 4]  # 2: two rows; 4 before 5 by position
    assert _counts(run, P_PICKS, P_HITS, P_PREFETCH_HITS, P_MISSES) == (4, 0, 3, 1)
    assert _counts(run, P_COPIED_EXPERTS, P_WASTED_EXPERTS, P_MISS_EXPERTS) == (2, 0, 1)


def test_no_prediction_or_a_budget_under_one_expert_copies_nothing():
    for run, predicted in ((_eight(pool=2), None), (_eight(pool=2, budget=MB // 2), [[2, 3]])):
        assert run.step(0, [2, 3], predicted) == []
        assert _counts(run, P_PREFETCH_HITS, P_MISSES, P_COPIED_EXPERTS) == (0, 2, 0)


def test_the_cache_admits_a_prefetched_pick_from_the_pool_and_scores_it_as_a_pick():
    freq = np.zeros((1, 8))
    freq[0, [0, 1]] = 1.0
    run = PrefetchReplay(ReferenceCache(freq, [(0, 0), (0, 1)]), 1, 10 * MB, MB, 0.5, 1.25, 1)
    assert run.step(0, [2, 3], [[2]]) == [2]
    # decayed 0.5 0.5, picks +1 on 2 and 3: candidate 2 (tie to the lower id) beats 1.25 * 0.5 and takes slot 0
    assert run.cache.freq[0, :4].tolist() == [0.5, 0.5, 1.0, 1.0]
    assert run.cache.residents(0) == [1, 2]
    assert _counts(run, P_PREFETCH_HITS, P_MISSES, P_FROM_POOL) == (1, 1, 1)
    assert run.cache.counters[0, C_HITS] == 0  # the cache's own hits: residents only


# ---- the slot split


@pytest.mark.parametrize("total, pool, buffers", [(32, 0, 1), (32, 2, 1), (32, 2, 2), (32, 2, 12), (24, 2, 12), (0, 0, 1)])
def test_the_split_conserves_the_slots(total, pool, buffers):
    split = Split(total, pool, buffers)
    assert split.cache_slots + split.pool * split.buffers == total and split.cache_slots >= 0


@pytest.mark.parametrize("total, pool, buffers", [(23, 2, 12), (4, -1, 1), (4, 1, 0), (-1, 0, 1)])
def test_a_split_that_does_not_fit_is_refused(total, pool, buffers):
    with pytest.raises(ValueError):
        Split(total, pool, buffers)


# ---- random traces


def _random_case(seed: int, max_rows: int = 1):
    logw = popularity(seed, "zipf", layers=3, experts=32)
    trace = routing_trace(logw, top_k=4, steps=150, max_rows=max_rows, seed=seed)
    return trace, picks_profile(trace, 32)


def _plain(trace, profile, slots, decay, hysteresis, max_admit) -> ReferenceCache:
    cache = ReferenceCache.warm(profile, slots, trace[0].shape[-1], decay)
    for step in trace:
        for layer, selected in enumerate(step):
            cache.step(layer, selected, decay, hysteresis, max_admit)
    return cache


def _noisy(trace, experts: int, width: int, seed: int):
    """A predictor of random experts plus half the true picks, [1, width], its order shuffled."""
    rng = np.random.default_rng([seed, 9])

    def predict(t, layer):
        true = np.unique(trace[t][layer])
        keep = true[rng.random(true.size) < 0.5]
        others = rng.choice(experts, size=width, replace=False)
        return rng.permutation(np.concatenate([keep, others]))[None, :width]

    return predict


POLICY = (0.9, 1.25, 2)


@pytest.mark.parametrize("seed, max_rows", [(0, 1), (1, 1), (2, 3)])
def test_prefetch_changes_nothing_of_the_cache_and_only_turns_misses_into_prefetch_hits(seed, max_rows):
    trace, profile = _random_case(seed, max_rows)
    plain = _plain(trace, profile, 24, *POLICY)
    run = replay(trace, profile, Split(24 + 2, pool=2), _noisy(trace, 32, 6, seed), 2 * MB, MB, *POLICY)
    for name in ("freq", "slot_of", "owner", "picks", "counters"):
        assert np.array_equal(getattr(run.cache, name), getattr(plain, name)), name
    c = run.counters
    assert np.array_equal(c[:, P_HITS] + c[:, P_PREFETCH_HITS] + c[:, P_MISSES], c[:, P_PICKS])
    assert np.array_equal(c[:, P_PICKS], plain.counters[:, C_PICKS])  # no entry out of range here
    assert np.array_equal(c[:, P_HITS], plain.counters[:, C_HITS])
    assert c[:, P_PREFETCH_HITS].sum() > 0 and c[:, P_WASTED_EXPERTS].sum() > 0
    assert np.all(c[:, P_COPIED_EXPERTS] <= 2 * c[:, P_STEPS])
    assert np.all(c[:, P_COPIED_EXPERTS] - c[:, P_WASTED_EXPERTS] <= c[:, P_PREFETCH_HITS])  # a used copy is picked


@pytest.mark.parametrize("seed", [0, 1])
def test_a_threshold_above_every_score_is_the_plain_cache_replay(seed):
    trace, profile = _random_case(seed)
    plain = _plain(trace, profile, 20, *POLICY)
    noisy = _noisy(trace, 32, 6, seed)

    def scored(t, layer):
        picks = noisy(t, layer)
        return picks, np.full(picks.shape, 0.99, dtype=np.float32)

    run = replay(trace, profile, Split(22, pool=2), scored, 2 * MB, MB, *POLICY, min_score=1.0)
    assert np.array_equal(run.cache.counters, plain.counters)
    assert run.counters[:, P_COPIED_EXPERTS].sum() == 0
    run = replay(trace, profile, Split(22, pool=2), scored, 2 * MB, MB, *POLICY, min_score=0.99)
    assert run.counters[:, P_COPIED_EXPERTS].sum() > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_zero_pool_is_the_plain_cache_replay_bit_for_bit(seed):
    trace, profile = _random_case(seed)
    plain = _plain(trace, profile, 20, *POLICY)
    for pool, budget in ((0, 10 * MB), (3, 0)):
        run = replay(trace, profile, Split(20 + pool, pool=pool), _noisy(trace, 32, 6, seed), budget, MB, *POLICY)
        for name in ("freq", "slot_of", "owner", "picks", "counters"):
            assert np.array_equal(getattr(run.cache, name), getattr(plain, name)), name
        c = run.counters.sum(axis=0)
        assert (c[P_PREFETCH_HITS], c[P_COPIED_EXPERTS]) == (0, 0)
        assert c[P_MISSES] == plain.counters[:, C_PICKS].sum() - plain.counters[:, C_HITS].sum()


@pytest.mark.parametrize("seed, max_rows", [(0, 1), (3, 2)])
def test_the_oracle_with_room_for_every_pick_leaves_no_miss_beyond_the_caches(seed, max_rows):
    trace, profile = _random_case(seed, max_rows)
    plain = _plain(trace, profile, 16, *POLICY)
    width = 4 * max_rows  # every distinct pick of the step

    def oracle(t, layer):
        return np.asarray(trace[t][layer]).reshape(1, -1)

    run = replay(trace, profile, Split(16 + width, pool=width), oracle, width * MB, MB, *POLICY)
    c = run.counters.sum(axis=0)
    cache_misses = plain.counters[:, C_PICKS].sum() - plain.counters[:, C_HITS].sum()
    assert (c[P_MISSES], c[P_MISS_EXPERTS], c[P_WASTED_EXPERTS]) == (0, 0, 0)
    assert c[P_PREFETCH_HITS] == cache_misses > 0
