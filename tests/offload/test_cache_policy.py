"""The cache's replacement policy (glm53.offload.cache_policy): steps worked out by hand, and the invariants of long
random routing traces. tests/gpu/test_cache_policy_kernel.py drives the CUDA kernel with the same traces."""

from __future__ import annotations

import numpy as np
import pytest

from glm53.offload.cache_policy import (
    C_ADMITS,
    C_EVICTS,
    C_HITS,
    C_PICKS,
    C_STEPS,
    Admission,
    ReferenceCache,
    placement,
    warm_scores,
)

POPULARITIES = ("zipf", "uniform")


def popularity(seed: int, kind: str, layers: int, experts: int) -> np.ndarray:
    """float [layers, experts] log-weights of the experts' popularity. ``zipf``: ``1 / rank ** 1.1`` over a random
    order of the experts per layer (as skewed as real routing); ``uniform``: every expert alike."""
    if kind == "uniform":
        return np.zeros((layers, experts))
    rng = np.random.default_rng([seed, 1])
    return np.stack([-1.1 * np.log1p(rng.permutation(experts)) for _ in range(layers)])


def routing_trace(logw: np.ndarray, top_k: int, steps: int, max_rows: int, seed: int) -> list[np.ndarray]:
    """Decode steps of 1 to ``max_rows`` rows (the same for every layer of a step), each row ``top_k`` distinct
    experts drawn by the popularity (Gumbel top-k): int64 [layers, rows, top_k] per step. Rows of one step often
    pick the same expert, as a batch of streams does."""
    rng = np.random.default_rng([seed, 2])
    layers, experts = logw.shape
    trace = []
    for _ in range(steps):
        rows = int(rng.integers(1, max_rows + 1))
        keys = logw[:, None, :] + rng.gumbel(size=(layers, rows, experts))
        trace.append(np.argpartition(-keys, top_k, axis=2)[:, :, :top_k].astype(np.int64))
    return trace


def picks_profile(trace: list[np.ndarray], experts: int) -> np.ndarray:
    """float [layers, experts]: the picks of each expert over a trace (a routing profile measured on it)."""
    return np.stack([np.bincount(np.concatenate([s[layer].reshape(-1) for s in trace]), minlength=experts)
                     for layer in range(trace[0].shape[0])]).astype(np.float64)


def _one_layer(freq, residents):
    return ReferenceCache(np.array([freq], dtype=np.float32), [(0, e) for e in residents])


# ---- steps worked out by hand (decay 0.5 keeps the arithmetic exact)


def test_a_step_decays_scores_adds_each_experts_picks_and_admits_the_best_candidates_into_the_weakest_slots():
    cache = _one_layer([8.0, 2.0, 6.0, 1.0, 4.0], residents=[0, 1, 3])  # slots 0, 1, 2
    # two rows: expert 2 is picked by both
    got = cache.step(0, [[2, 0], [2, 4]], decay=0.5, hysteresis=1.25, max_admit=2)
    # decayed: 4 1 3 0.5 2; picks added: 5 1 5 0.5 3. Candidates 2 (5) and 4 (3); victims 3 (0.5) and 1 (1)
    assert cache.freq.tolist() == [[5.0, 1.0, 5.0, 0.5, 3.0]]
    assert got == [Admission(expert=2, slot=2, evicted=3), Admission(expert=4, slot=1, evicted=1)]
    assert cache.slot_of.tolist() == [[0, -1, 2, -1, 1]]
    assert cache.owner.tolist() == [0, 4, 2]
    assert cache.picks.tolist() == [[1, 0, 2, 0, 1]]
    c = cache.counters[0]
    assert (c[C_PICKS], c[C_HITS], c[C_ADMITS], c[C_EVICTS], c[C_STEPS]) == (4, 1, 2, 2, 1)  # expert 0 hit once


@pytest.mark.parametrize("hysteresis, max_admit, admitted", [
    (1.25, 1, [2]),  # the limit: the best candidate first
    (3.5, 2, [2]),  # 5 > 3.5 * 0.5, but 3 <= 3.5 * 1
    (3.0, 2, [2]),  # 3 > 3.0 * 1 is false: the comparison is strict
    (10.0, 2, []),  # 5 <= 10 * 0.5: nothing beats the weakest resident, so nothing else is tried
    (1.25, 0, []),
])
def test_admission_stops_at_the_limit_or_at_the_first_candidate_short_of_the_hysteresis(hysteresis, max_admit, admitted):
    cache = _one_layer([8.0, 2.0, 6.0, 1.0, 4.0], residents=[0, 1, 3])
    got = cache.step(0, [[2, 0], [2, 4]], decay=0.5, hysteresis=hysteresis, max_admit=max_admit)
    assert [a.expert for a in got] == admitted
    assert cache.counters[0, C_ADMITS] == cache.counters[0, C_EVICTS] == len(admitted)
    assert cache.freq.tolist() == [[5.0, 1.0, 5.0, 0.5, 3.0]]  # scores move whatever is admitted


def test_equal_scores_go_to_the_lower_expert_id_for_both_the_admitted_and_the_evicted():
    cache = _one_layer([2.0] * 6, residents=[4, 1, 2])  # slot 0 holds expert 4
    got = cache.step(0, [5, 3, 0], decay=0.5, hysteresis=1.25, max_admit=2)  # candidates 0, 3, 5 at 2.0, victims at 1.0
    assert got == [Admission(0, 1, 1), Admission(3, 2, 2)]
    assert cache.residents(0) == [0, 3, 4]


def test_an_expert_picked_in_the_step_is_never_evicted_however_low_its_score():
    cache = _one_layer([0.0, 10.0, 10.0], residents=[0])
    assert cache.step(0, [0, 1], decay=0.5, hysteresis=1.0, max_admit=2) == []
    assert cache.residents(0) == [0] and cache.counters[0, C_HITS] == 1


def test_several_picks_of_an_expert_in_one_step_are_added_in_one_float32_addition():
    big = np.float32(2**24)  # float32 steps by 2 here: + 1 rounds back down (to even), + 3 rounds up to + 4
    cache = _one_layer([big, 0.0], residents=[1])
    cache.step(0, [[0], [0], [0]], decay=1.0, hysteresis=1.25, max_admit=0)
    assert cache.freq[0, 0] == big + 4
    assert ((big + np.float32(1)) + np.float32(1)) + np.float32(1) == big  # what three additions would give
    assert cache.picks[0, 0] == 3 and cache.counters[0, C_PICKS] == 3


def test_the_hysteresis_product_is_rounded_to_float32_before_the_comparison():
    victim = np.float32(1.0015)
    bar = np.float32(1.25) * victim  # rounded up from the exact product
    assert float(bar) > 1.25 * float(victim)
    before = bar - np.float32(1)  # one pick (decay 1) brings the candidate exactly to the bar
    assert before + np.float32(1) == bar
    cache = _one_layer([before, victim], residents=[1])
    assert cache.step(0, [0], decay=1.0, hysteresis=1.25, max_admit=1) == []  # bar > bar is false
    assert float(cache.freq[0, 0]) > 1.25 * float(victim)  # in float64 it would have been admitted


def test_the_decay_is_the_float32_nearest_to_the_setting():
    cache = _one_layer([3.0, 7.0], residents=[])
    cache.step(0, [], decay=0.995, hysteresis=1.25, max_admit=2)
    assert cache.freq.tolist() == [[np.float32(3.0) * np.float32(0.995), np.float32(7.0) * np.float32(0.995)]]
    assert cache.freq[0, 0] != np.float32(3.0 * 0.995)  # the float64 product rounds otherwise
    assert cache.counters[0, C_STEPS] == 1 and cache.counters[0, C_PICKS] == 0


def test_entries_outside_the_layer_are_ignored_but_counted_as_picks_like_the_kernel():
    cache = _one_layer([1.0, 1.0, 1.0, 1.0], residents=[0])
    assert cache.step(0, [-1, 2, 4], decay=0.5, hysteresis=1.25, max_admit=2) == [Admission(2, 0, 0)]
    assert cache.picks.tolist() == [[0, 0, 1, 0]] and cache.freq.tolist() == [[0.5, 0.5, 1.5, 0.5]]
    assert cache.counters[0, C_PICKS] == 3  # the kernel adds n, every entry it was given


def test_layers_keep_their_own_slots_and_scores():
    cache = ReferenceCache(np.array([[1.0, 1.0], [1.0, 1.0]]), [(1, 0), (0, 1)])
    assert cache.step(1, [1], decay=0.5, hysteresis=1.25, max_admit=2) == [Admission(1, 0, 0)]  # layer 1's own slot
    assert cache.slot_of.tolist() == [[-1, 1], [-1, 0]] and cache.owner.tolist() == [3, 1]
    assert cache.freq.tolist() == [[1.0, 1.0], [0.5, 1.5]]
    assert cache.counters[0].tolist() == [0] * 8


def _per_layer(pairs, layers=2):
    out = [[] for _ in range(layers)]
    for l, e in pairs:
        out[l].append(e)
    return [sorted(x) for x in out]


def test_the_placement_gives_slots_to_the_most_picked_experts_across_layers_hottest_first():
    profile = np.array([
        [10, 10, 10, 10],  # flat: every expert a quarter of the layer's picks
        [70, 20, 5, 5],  # skewed
    ], dtype=float)
    assert placement(profile, 0) == []
    assert placement(profile, 3) == [(1, 0), (0, 0), (0, 1)]  # 0.70, then the 0.25s by expert id
    assert _per_layer(placement(profile, 6)) == [[0, 1, 2, 3], [0, 1]]  # the flat layer's 0.25s beat 0.20
    assert _per_layer(placement(profile, 100)) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    # no profile: every expert counts the same; slots spread over the layers, lowest ids first
    assert placement(np.zeros((2, 4)), 3) == [(0, 0), (1, 0), (0, 1)]


def test_the_warm_start_fills_the_slots_by_the_placement_with_the_profiles_steady_scores():
    profile = np.array([[70.0, 20.0, 5.0, 5.0], [10.0, 10.0, 10.0, 10.0]])
    cache = ReferenceCache.warm(profile, slots=3, top_k=8, decay=0.995)
    assert placement(profile, 3) == [(0, 0), (1, 0), (1, 1)]
    assert cache.owner.tolist() == [0, 4, 5]
    assert cache.slot_of.tolist() == [[0, -1, -1, -1], [1, 2, -1, -1]]
    # share * top_k / (1 - decay): 0.7 * 8 / 0.005 = 1120 for layer 0's expert 0
    assert cache.freq.dtype == np.float32 and np.array_equal(cache.freq, warm_scores(profile, 8, 0.995))
    assert cache.freq[0, 0] == np.float32(0.7 * 8 / (1 - 0.995)) and cache.freq[1, 3] == np.float32(0.25 * 8 / (1 - 0.995))
    # no profile: uniform scores, slots spread over the layers; more slots than experts: every expert
    cold = ReferenceCache.warm(np.zeros((2, 4)), slots=3, top_k=8, decay=0.995)
    assert cold.owner.tolist() == [0, 4, 1] and len(set(cold.freq.reshape(-1).tolist())) == 1
    assert len(ReferenceCache.warm(profile, slots=100, top_k=8, decay=0.995).owner) == 8


def test_a_resident_list_that_names_an_expert_twice_or_outside_the_layers_is_refused():
    with pytest.raises(ValueError, match="slot 1"):
        ReferenceCache(np.zeros((1, 4)), [(0, 2), (0, 2)])
    with pytest.raises(ValueError, match="slot 0"):
        ReferenceCache(np.zeros((1, 4)), [(1, 0)])


# ---- invariants over random traces

SLOTS = {"none": lambda total: 0, "one": lambda total: 1, "partial": lambda total: total // 9, "all": lambda total: total}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("kind", POPULARITIES)
@pytest.mark.parametrize("slots", list(SLOTS))
def test_on_random_traces_every_step_keeps_the_policys_invariants(seed, kind, slots):
    layers, experts, top_k, decay, hysteresis, max_admit = 3, 48, 6, 0.98, 1.25, 2
    logw = popularity(seed, kind, layers, experts)
    trace = routing_trace(logw, top_k, steps=150, max_rows=4, seed=seed)
    # the skewed case starts warm, from a profile measured on other steps; the uniform one cold (no profile)
    profile = picks_profile(routing_trace(logw, top_k, 40, 1, seed + 100), experts) if kind == "zipf" else np.zeros((layers, experts))
    total = layers * experts
    cache = ReferenceCache.warm(profile, SLOTS[slots](total), top_k, decay)
    quota = (cache.slot_of >= 0).sum(axis=1)
    exact = cache.freq.astype(np.float64)  # the scores in float64, for the drift of float32 rounding
    hits = admissions = 0
    for step in trace:
        for layer in range(layers):
            sel = step[layer]
            count = np.bincount(sel.reshape(-1), minlength=experts)
            before = cache.slot_of[layer] >= 0
            got = cache.step(layer, sel, decay, hysteresis, max_admit)
            f = cache.freq[layer]
            exact[layer] = exact[layer] * decay + count
            hits += int(count[before].sum())
            admissions += len(got)
            assert len(got) <= max_admit
            for a in got:
                assert count[a.expert] > 0 and not before[a.expert]  # picked and missed
                assert count[a.evicted] == 0 and before[a.evicted]  # resident and not in use
                assert f[a.expert] > np.float32(hysteresis) * f[a.evicted]
            assert [f[a.expert] for a in got] == sorted((f[a.expert] for a in got), reverse=True)
            assert [f[a.evicted] for a in got] == sorted(f[a.evicted] for a in got)
            after = cache.slot_of[layer] >= 0
            if len(got) < max_admit:  # it stopped early: nothing left that beats the weakest resident not in use
                left, weak = f[(count > 0) & ~after], f[(count == 0) & after]
                assert left.size == 0 or weak.size == 0 or not left.max() > np.float32(hysteresis) * weak.min()
        assert np.array_equal((cache.slot_of >= 0).sum(axis=1), quota)  # a layer keeps its share of the slots
        owned = np.flatnonzero(cache.slot_of.reshape(-1) >= 0)
        assert sorted(cache.owner.tolist()) == owned.tolist()
        assert np.array_equal(cache.slot_of.reshape(-1)[cache.owner], np.arange(len(cache.owner)))
    np.testing.assert_allclose(cache.freq, exact, rtol=1e-5)
    assert np.array_equal(cache.picks, picks_profile(trace, experts))
    counters = cache.counters.sum(axis=0)
    assert counters[C_PICKS] == sum(s.size for s in trace) and counters[C_HITS] == hits
    assert counters[C_ADMITS] == counters[C_EVICTS] == admissions and counters[C_STEPS] == len(trace) * layers
    if slots == "none":
        assert hits == admissions == 0
    if slots == "all":
        assert hits == counters[C_PICKS] and admissions == 0
    if slots == "partial" and kind == "zipf":
        assert 0 < admissions and 0 < hits < counters[C_PICKS]


def test_without_admissions_the_residents_never_change():
    trace = routing_trace(popularity(4, "zipf", 2, 32), 4, steps=60, max_rows=3, seed=4)
    cache = ReferenceCache.warm(np.zeros((2, 32)), slots=10, top_k=4, decay=0.995)
    start = cache.slot_of.copy()
    for step in trace:
        for layer in range(2):
            assert cache.step(layer, step[layer], 0.995, 1.25, max_admit=0) == []
    assert np.array_equal(cache.slot_of, start)
