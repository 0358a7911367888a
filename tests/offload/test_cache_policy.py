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
    NO_RECENCY,
    Admission,
    Recency,
    ReferenceCache,
    placement,
    popularity_lift,
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


def recurring_trace(logw: np.ndarray, top_k: int, steps: int, keep: float, seed: int) -> list[np.ndarray]:
    """One-row decode steps whose picks recur, as a trained router's do: each of a layer's previous picks is picked
    again with probability ``keep``, the rest drawn by the popularity among the others: int64 [layers, 1, top_k]."""
    rng = np.random.default_rng([seed, 4])
    layers, experts = logw.shape
    last = [np.argpartition(-(w + rng.gumbel(size=experts)), top_k)[:top_k] for w in logw]
    trace = []
    for _ in range(steps):
        step = []
        for layer in range(layers):
            kept = last[layer][rng.random(top_k) < keep]
            keys = logw[layer] + rng.gumbel(size=experts)
            keys[kept] = -np.inf
            last[layer] = np.concatenate([kept, np.argsort(-keys)[: top_k - len(kept)]])
            step.append(last[layer][None, :])
        trace.append(np.stack(step).astype(np.int64))
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


def test_spare_slots_go_first_the_lowest_scored_spare_first_and_without_the_hysteresis():
    cache = _one_layer([8.0, 2.0, 6.0, 1.0, 4.0, 12.0], residents=[0, 1, 3, 5])  # slots 0, 1, 2, 3
    spare = np.array([True, False, False, False, False, True])  # experts 0 and 5 (in VRAM, say)
    # decayed and picked: 4 1 5 0.5 3 6. Candidates 2 (5), 4 (3); spare victims 0 (4), 5 (6): 2 takes 0's slot, then
    # 4 takes 5's though 3 <= 10 * 6; then no spare victim is left, and 1 (1) and 3 (0.5) keep theirs under the hysteresis
    got = cache.step(0, [2, 4, 2], decay=0.5, hysteresis=10.0, max_admit=4, spare=spare)
    assert got == [Admission(expert=2, slot=0, evicted=0), Admission(expert=4, slot=3, evicted=5)]
    assert cache.slot_of.tolist() == [[-1, 1, 0, 2, 3, -1]]
    shared = _one_layer([8.0, 2.0, 6.0, 1.0, 4.0, 12.0], residents=[0, 1, 3, 5])
    assert shared.step(0, [2, 4, 2], decay=0.5, hysteresis=10.0, max_admit=4) == []  # without spare: nothing beats 10 x 0.5


def test_a_spare_expert_picked_in_the_step_keeps_its_slot_and_the_other_victims_follow_the_hysteresis():
    cache = _one_layer([8.0, 2.0, 6.0, 1.0], residents=[0, 3])
    spare = np.array([True, False, False, False])
    # 0 is spare but picked: not a victim. 2 (4) against 3 (0.5) at 1.25: admitted into slot 1
    assert cache.step(0, [0, 2], decay=0.5, hysteresis=1.25, max_admit=2, spare=spare) == [Admission(2, 1, 3)]


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


def test_the_fast_score_weighs_by_the_measured_reuse_over_popularitys_and_can_decide_an_admission():
    """Worked by hand (halves and quarters: exact in float32). Expert 2 was the previous step's pick and is picked
    again with expert 3: reuse lift 1/1 - 1/4 = 0.75; the average 0.25 * 0.5 + 0.5 * 0.75 = 0.5 is 0.25 above
    popularity's, so the fast score weighs 8 * 0.25 = 2."""
    recency = Recency(decay=0.5, weight=8.0, keep=0.5)

    def cache():
        c = ReferenceCache(np.array([[8.0, 2.0, 6.0, 4.0, 10.0]]), [(0, 0), (0, 1), (0, 4)], popularity=np.array([0.25]))
        c.prev[0, 2] = True
        return c

    with_recency = cache()
    got = with_recency.step(0, [2, 3], decay=0.5, hysteresis=1.2, max_admit=4, recency=recency)
    # slow 4 1 4 3 5, fast 0 0 1 1 0: scores 4 1 6 5 5. Candidates 2 (6), 3 (5); victims 1 (1), 0 (4), 4 (5)
    assert got == [Admission(2, 1, 1), Admission(3, 0, 0)]  # 5 > 1.2 * 4
    assert with_recency.freq.tolist() == [[4.0, 1.0, 4.0, 3.0, 5.0]] and with_recency.recent.tolist() == [[0, 0, 1, 1, 0]]
    assert with_recency.reuse.tolist() == [[0.5, 0.25]] and with_recency.prev.tolist() == [[False, False, True, True, False]]
    assert with_recency.slot_of.tolist() == [[-1, -1, 1, 0, 2]]
    slow_only = cache()  # the same state without the weight: the slow scores alone, 3 <= 1.2 * 4
    assert slow_only.step(0, [2, 3], decay=0.5, hysteresis=1.2, max_admit=4, recency=recency._replace(weight=0.0)) == [Admission(2, 1, 1)]
    assert slow_only.reuse.tolist() == [[0.5, 0.25]]  # measured all the same


def test_a_reuse_lift_below_popularitys_gives_no_weight():
    c = ReferenceCache(np.array([[1.0, 1.0, 1.0, 1.0]]), [(0, 0)], popularity=np.array([0.5]))
    c.prev[0, 1] = True
    # previous expert 1 not picked again: lift 0 / 1 - 1 / 3 < 0, the average falls below popularity's 0.5
    got = c.step(0, [3], decay=1.0, hysteresis=1.0, max_admit=1, recency=Recency(decay=0.5, weight=1e6, keep=0.5))
    assert c.reuse[0, 0] == np.float32(0.25) - np.float32(0.5) * (np.float32(1) / np.float32(3))
    assert got == [Admission(3, 0, 0)] and c.freq[0, 3] == 2.0  # 2 > 1: the slow scores decided, as with weight 0


@pytest.mark.parametrize("prev", [[], [0, 1, 2]])
def test_the_reuse_average_holds_when_the_previous_step_picked_nothing_or_every_expert(prev):
    c = ReferenceCache(np.zeros((1, 3)), [], popularity=np.array([0.125]))
    c.prev[0, prev] = True
    c.step(0, [[0], [1]], decay=0.5, hysteresis=1.25, max_admit=2, recency=Recency(decay=0.5, weight=1.0, keep=0.5))
    assert c.reuse.tolist() == [[0.125, 0.125]] and c.prev.tolist() == [[True, False, False]]  # the first row's


def test_the_reuse_lift_is_measured_on_the_first_row_of_a_step_one_stream():
    """Rows of other streams picking the previous step's experts again do not count: only row 0 recurs or not."""
    recency = Recency(decay=0.5, weight=1.0, keep=0.5)
    c = ReferenceCache(np.zeros((1, 6)), [], popularity=np.array([0.0]))
    c.step(0, [[0, 1], [2, 3]], decay=0.5, hysteresis=1.25, max_admit=0, recency=recency)
    assert c.prev.tolist() == [[True, True, False, False, False, False]]
    c.step(0, [[0, 4], [1, 5]], decay=0.5, hysteresis=1.25, max_admit=0, recency=recency)  # row 0: 0 again, 4 new
    # 1 of the 2 previous experts again, 1 of the 4 others: 1/2 - 1/4; row 1's pick of expert 1 is another stream's
    assert c.reuse.tolist() == [[0.125, 0.0]] and c.prev.tolist() == [[True, False, False, False, True, False]]
    assert c.picks.tolist() == [[2, 2, 1, 1, 1, 1]]  # every row's picks count for the scores and the picks


def test_popularitys_reuse_lift_is_zero_for_even_routing_and_grows_with_skew():
    # top 2 of 4: chances 1, 0.5, 0.5, 0 -> 1.5 / 2 - 0.5 / 2; even ones 0.5 each -> 1 / 2 - 1 / 2
    assert popularity_lift(np.array([[2.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]), 2).tolist() == [0.5, 0.0]
    assert popularity_lift(np.zeros((1, 4)), 2).tolist() == [0.0]  # no profile: even
    assert popularity_lift(np.ones((1, 2)), 2).tolist() == [1.0]  # every expert every step (the step never measures it)


def test_recurring_picks_give_the_fast_score_weight_and_hits_and_independent_picks_do_not():
    layers, experts, top_k, slots = 3, 48, 6, 48
    logw = popularity(5, "zipf", layers, experts)
    profile = picks_profile(routing_trace(logw, top_k, 200, 1, 105), experts)
    recency = Recency(decay=0.5, weight=800.0, keep=0.99)
    runs = {}
    for name, trace in (("recurring", recurring_trace(logw, top_k, 300, 0.6, 5)), ("independent", routing_trace(logw, top_k, 300, 1, 5))):
        for weight in (0.0, recency.weight):
            cache = ReferenceCache.warm(profile, slots, top_k, 0.999, recency._replace(weight=weight))
            for step in trace:
                for layer in range(layers):
                    cache.step(layer, step[layer], 0.999, 1.25, 8, recency._replace(weight=weight))
            runs[name, weight] = (cache.counters[:, C_HITS].sum() / cache.counters[:, C_PICKS].sum(), cache.reuse[:, 0] - cache.reuse[:, 1])
    hit, excess = runs["recurring", recency.weight]
    assert (excess > 0.3).all() and hit > runs["recurring", 0.0][0] + 0.1
    hit, excess = runs["independent", recency.weight]
    assert (excess < 0.03).all() and abs(hit - runs["independent", 0.0][0]) < 0.01  # popularity alone: (almost) no weight


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
    cache = ReferenceCache.warm(profile, slots=3, top_k=8, decay=0.995, recency=Recency(decay=0.5, weight=800.0, keep=0.99))
    assert placement(profile, 3) == [(0, 0), (1, 0), (1, 1)]
    assert np.array_equal(cache.recent, warm_scores(profile, 8, 0.5)) and not cache.prev.any()
    assert np.array_equal(cache.reuse, np.repeat(popularity_lift(profile, 8)[:, None], 2, axis=1))  # no weight at start
    assert cache.owner.tolist() == [0, 4, 5]
    assert cache.slot_of.tolist() == [[0, -1, -1, -1], [1, 2, -1, -1]]
    # share * top_k / (1 - decay): 0.7 * 8 / 0.005 = 1120 for layer 0's expert 0
    assert cache.freq.dtype == np.float32 and np.array_equal(cache.freq, warm_scores(profile, 8, 0.995))
    assert cache.freq[0, 0] == np.float32(0.7 * 8 / (1 - 0.995)) and cache.freq[1, 3] == np.float32(0.25 * 8 / (1 - 0.995))
    # no profile: uniform scores, slots spread over the layers; more slots than experts: every expert
    cold = ReferenceCache.warm(np.zeros((2, 4)), slots=3, top_k=8, decay=0.995)
    assert cold.owner.tolist() == [0, 4, 1] and len(set(cold.freq.reshape(-1).tolist())) == 1
    assert len(ReferenceCache.warm(profile, slots=100, top_k=8, decay=0.995).owner) == 8


def test_a_warm_horizon_caps_the_warm_start_at_that_many_steps_of_the_profiles_picks():
    profile = np.array([[70.0, 20.0, 5.0, 5.0], [10.0, 10.0, 10.0, 10.0]])
    # share * top_k * horizon: 0.7 * 8 * 200 = 1120 at decay 0.999 (uncapped: 0.7 * 8 / 0.001 = 5600)
    capped = warm_scores(profile, 8, 0.999, horizon=200)
    assert capped.dtype == np.float32
    assert capped.tolist() == np.float32([[1120.0, 320.0, 80.0, 80.0], [400.0, 400.0, 400.0, 400.0]]).tolist()
    assert warm_scores(profile, 8, 0.999)[0, 0] == np.float32(0.7 * 8 / (1 - 0.999))
    # a horizon at or beyond 1 / (1 - decay) changes nothing, bit for bit: 200 steps is decay 0.995's own
    for horizon in (None, 200, 1e6):
        assert warm_scores(profile, 8, 0.995, horizon).tobytes() == (profile / profile.sum(1, keepdims=True) * 8 / (1 - 0.995)).astype(np.float32).tobytes()
    # the fast score's own horizon (2 steps at 0.5) is below any cap the policy takes, so it stays
    assert np.array_equal(warm_scores(profile, 8, 0.5, horizon=200), warm_scores(profile, 8, 0.5))
    warm = ReferenceCache.warm(profile, slots=3, top_k=8, decay=0.999, recency=Recency(0.5, 200.0, 0.99), warm_horizon=200)
    assert np.array_equal(warm.freq, capped) and np.array_equal(warm.recent, warm_scores(profile, 8, 0.5))


def test_a_resident_list_that_names_an_expert_twice_or_outside_the_layers_is_refused():
    with pytest.raises(ValueError, match="slot 1"):
        ReferenceCache(np.zeros((1, 4)), [(0, 2), (0, 2)])
    with pytest.raises(ValueError, match="slot 0"):
        ReferenceCache(np.zeros((1, 4)), [(1, 0)])


# ---- invariants over random traces

SLOTS = {"none": lambda total: 0, "one": lambda total: 1, "partial": lambda total: total // 9, "all": lambda total: total}


TRACES = {"independent": lambda logw, top_k, seed: routing_trace(logw, top_k, steps=150, max_rows=4, seed=seed),
          "recurring": lambda logw, top_k, seed: recurring_trace(logw, top_k, steps=150, keep=0.6, seed=seed)}
RECENCIES = {"slow-only": NO_RECENCY, "two-timescale": Recency(decay=0.5, weight=800.0, keep=0.9)}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("kind", POPULARITIES)
@pytest.mark.parametrize("slots", list(SLOTS))
@pytest.mark.parametrize("traced, recency", [("independent", "slow-only"), ("recurring", "two-timescale")])
def test_on_random_traces_every_step_keeps_the_policys_invariants(seed, kind, slots, traced, recency):
    layers, experts, top_k, decay, hysteresis, max_admit = 3, 48, 6, 0.98, 1.25, 2
    recency = RECENCIES[recency]
    logw = popularity(seed, kind, layers, experts)
    trace = TRACES[traced](logw, top_k, seed)
    # the skewed case starts warm, from a profile measured on other steps; the uniform one cold (no profile)
    profile = picks_profile(routing_trace(logw, top_k, 40, 1, seed + 100), experts) if kind == "zipf" else np.zeros((layers, experts))
    total = layers * experts
    cache = ReferenceCache.warm(profile, SLOTS[slots](total), top_k, decay, recency)
    quota = (cache.slot_of >= 0).sum(axis=1)
    exact = cache.freq.astype(np.float64)  # the scores in float64, for the drift of float32 rounding
    exact_recent = cache.recent.astype(np.float64)
    hits = admissions = 0
    for step in trace:
        for layer in range(layers):
            sel = step[layer]
            count = np.bincount(sel.reshape(-1), minlength=experts)
            before = cache.slot_of[layer] >= 0
            got = cache.step(layer, sel, decay, hysteresis, max_admit, recency)
            excess = cache.reuse[layer, 0] - cache.reuse[layer, 1]
            score = cache.freq[layer] + np.float32(recency.weight) * (excess if excess > 0 else np.float32(0)) * cache.recent[layer]
            exact[layer] = exact[layer] * decay + count
            exact_recent[layer] = exact_recent[layer] * recency.decay + count
            hits += int(count[before].sum())
            admissions += len(got)
            assert len(got) <= max_admit
            for a in got:
                assert count[a.expert] > 0 and not before[a.expert]  # picked and missed
                assert count[a.evicted] == 0 and before[a.evicted]  # resident and not in use
                assert score[a.expert] > np.float32(hysteresis) * score[a.evicted]
            assert [score[a.expert] for a in got] == sorted((score[a.expert] for a in got), reverse=True)
            assert [score[a.evicted] for a in got] == sorted(score[a.evicted] for a in got)
            after = cache.slot_of[layer] >= 0
            if len(got) < max_admit:  # it stopped early: nothing left that beats the weakest resident not in use
                left, weak = score[(count > 0) & ~after], score[(count == 0) & after]
                assert left.size == 0 or weak.size == 0 or not left.max() > np.float32(hysteresis) * weak.min()
        assert np.array_equal((cache.slot_of >= 0).sum(axis=1), quota)  # a layer keeps its share of the slots
        owned = np.flatnonzero(cache.slot_of.reshape(-1) >= 0)
        assert sorted(cache.owner.tolist()) == owned.tolist()
        assert np.array_equal(cache.slot_of.reshape(-1)[cache.owner], np.arange(len(cache.owner)))
    np.testing.assert_allclose(cache.freq, exact, rtol=1e-5)
    np.testing.assert_allclose(cache.recent, exact_recent, rtol=1e-5, atol=1e-30)
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


def test_the_next_step_of_a_layer_is_predicted_from_its_rows_alone_with_recency_and_several_rows():
    """``cache.predicted_admissions`` on host copies of one layer's rows (what the RAM tier's part reads at the sync)
    makes the decisions the whole state's step makes, step after step: the write-back's prediction."""
    from glm53.offload.cache import Policy, predicted_admissions

    rng = np.random.default_rng(4)
    layers, experts = 3, 40
    profile = rng.random((layers, experts)) ** 4
    policy = Policy(decay=0.9, hysteresis=1.05, max_admit=3, recency_weight=50.0)
    state = ReferenceCache.warm(profile, 18, 4, policy.decay, policy.recency, policy.warm_horizon)
    admitted = 0
    for _ in range(200):
        for layer in range(layers):
            picks = np.stack([rng.choice(experts, 4, replace=False, p=profile[layer] / profile[layer].sum()) for _ in range(2)])
            rows = [a[layer].copy() for a in (state.freq, state.recent, state.prev, state.reuse, state.slot_of)]
            predicted = predicted_admissions(policy, picks, *rows)
            actual = state.step(layer, picks, policy.decay, policy.hysteresis, policy.max_admit, policy.recency)
            assert predicted == actual
            admitted += len(actual)
    assert admitted > 50
