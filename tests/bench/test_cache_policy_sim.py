"""The cache-policy replay: each policy on traces whose answer is known by hand."""

from __future__ import annotations

import numpy as np

from bench import cache_policy_sim as sim
from glm53.offload.cache import Policy


def _cyclic(experts: int, steps: int) -> np.ndarray:
    """One layer, one pick per step, cycling through ``experts`` experts: [steps, 1, 1]."""
    return (np.arange(steps) % experts).reshape(steps, 1, 1)


def test_a_cycle_one_longer_than_the_cache_defeats_lru_and_clock_but_not_belady():
    trace, start = _cyclic(4, 400), [[0, 1, 2]]  # 3 slots, 4 experts in turn
    assert sim.run_lru(trace, start) == 3  # only the warm first pass hits
    assert sim.run_clock(trace, start) == 3
    # Belady keeps 2 of the 3 slots useful: after the first pass it hits 2 of every 3 misses' worth
    assert sim.run_belady(trace, start) >= 0.6 * 400
    assert sim.run_static(trace, start) == 300  # experts 0-2 of every cycle


def test_the_kernels_policy_admits_only_what_beats_the_weakest_resident():
    profile = np.array([[10.0, 1.0, 1.0, 1.0]])  # expert 0 is hot
    start = [[0, 1]]
    trace = np.array([[[2]], [[2]], [[2]], [[1]]])  # expert 2 is picked three times, then 1
    policy = Policy(decay=1.0, hysteresis=1.25, max_admit=2)
    # warm scores (top-k 1, decay 1: infinite horizon -> 1e6 scale) keep 0 and 1; one pick of 2 cannot beat 1
    assert sim.run_decayed(trace, start, profile, policy) == 1  # only the last pick (expert 1) hits
    assert sim.run_decayed(trace, start, profile, Policy(max_admit=0)) == sim.run_static(trace, start)


def test_on_the_real_profile_belady_bounds_every_online_policy():
    profile = sim.load_profile(sim.PROFILE)[:4]  # four real layers keep the test fast
    trace = sim.make_trace(profile, steps=300, top_k=8, mode="drift", seed=3)
    result = sim.simulate(profile, trace, slots=round(0.11 * profile.size))
    rates = result["hit_rate"]
    assert result["picks"] == 300 * 4 * 8
    assert all(0.0 < rates[p] <= rates["belady"] for p in sim.POLICIES)
    assert rates["decayed"] > rates["clock"]  # frequency beats recency on skewed routing
