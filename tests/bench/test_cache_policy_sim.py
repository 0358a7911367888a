"""The cache-policy replay: each policy on traces whose answer is known by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

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
    assert sim.run_static(trace, start) == sim.run_static_hindsight(trace, start) == 300  # experts 0-2 of every cycle
    # admitting every miss costs Belady little here: it evicts the resident whose turn comes last
    assert 0.6 * 400 <= sim.run_belady(trace, start, bypass=False) <= sim.run_belady(trace, start)


def test_the_hindsight_placement_holds_each_layers_most_picked_experts_of_the_trace():
    trace = np.array([[[3, 1], [0, 2]], [[3, 2], [0, 1]], [[3, 0], [1, 2]]])  # [steps 3, layers 2, top-k 2]
    start = [[0], [0, 1]]  # the profile's: one slot in layer 0, two in layer 1
    assert sim.run_static(trace, start) == 1 + 4  # layer 0: expert 0 once; layer 1: 0 and 1 twice each
    assert sim.run_static_hindsight(trace, start) == 3 + 4  # layer 0: expert 3 every step


def test_the_static_set_by_the_true_probabilities_holds_each_layers_most_likely_experts():
    trace = np.array([[[3, 1], [0, 2]], [[3, 2], [0, 1]], [[3, 0], [1, 2]]])  # [steps 3, layers 2, top-k 2]
    start = [[0], [0, 1]]
    probabilities = np.array([[0.1, 0.5, 0.2, 0.2], [0.3, 0.3, 0.3, 0.1]])
    assert sim.run_static_by(trace, start, probabilities) == 1 + 4  # layer 0: expert 1 once; layer 1: 0 and 1 (ties: lower id)
    assert sim.expected_static_hit_rate(start, probabilities, top_k=2) == (0.5 + 0.6) / (2 * 2)


def test_on_iid_picks_the_online_bound_is_the_static_set_by_the_true_probabilities():
    profile = sim.load_profile(sim.PROFILE)[:4]
    trace = sim.make_trace(profile, steps=300, top_k=8, mode="iid", seed=3)
    result = sim.simulate(profile, trace, slots=round(0.11 * profile.size), probabilities=sim.shares(profile), iid=True)
    rates, bound = result["hit_rate"], result["online_bound"]
    expected = sim.expected_static_hit_rate(sim.starting_residents(profile, round(0.11 * profile.size)), sim.shares(profile), 8)
    assert bound == {"policy": "static_true", "hit_rate": rates["static_true"], "is_bound": True,
                     "of_belady": round(rates["static_true"] / rates["belady"], 3), "expected": round(expected, 4)}
    assert rates["static_true"] == rates["static"]  # the profile generated the trace, so its placement is the true one
    assert rates["static_true"] <= rates["static_hindsight"] and result["of_online_bound"]["static_true"] == 1.0
    assert result["of_online_bound"]["decayed"] == round(rates["decayed"] / rates["static_true"], 3)
    # without the probabilities: the hindsight set, an upper estimate, and no bound where picks recur
    drift = sim.simulate(profile, sim.make_trace(profile, steps=300, top_k=8, mode="drift", seed=3), slots=round(0.11 * profile.size))
    assert drift["online_bound"]["policy"] == "static_hindsight" and not drift["online_bound"]["is_bound"]


def test_a_twins_pick_probabilities_are_its_routings_and_sum_to_top_k():
    from glm53.tools.synth import routing

    twin = routing.Twin(0, [1, 2], [np.zeros(16, dtype=np.float32), np.linspace(0, 0.5, 16, dtype=np.float32)], 2, None)
    p = sim.pick_probabilities(twin, samples=20_000, seed=0)
    assert p.shape == (2, 16) and np.allclose(p.sum(axis=1), 2.0)
    assert abs(p[0] - 2 / 16).max() < 0.01  # no bias: every expert alike
    assert p[1, -1] > 2 * p[1, 0]  # a larger selection bias, more picks
    picks = twin.run(4000, trace_seed=1).picks
    seen = np.stack([np.bincount(picks[:, i].reshape(-1), minlength=16) / 4000 for i in range(2)])
    assert abs(seen - p).max() < 0.03


def test_the_kernels_policy_admits_only_what_beats_the_weakest_resident():
    profile = np.array([[10.0, 1.0, 1.0, 1.0]])  # expert 0 is hot
    start = [[0, 1]]
    trace = np.array([[[2]], [[2]], [[2]], [[1]]])  # expert 2 is picked three times, then 1
    policy = Policy(decay=1.0, hysteresis=1.25, max_admit=2, warm_horizon=None)
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
    assert rates["static"] <= rates["static_hindsight"] and rates["belady_no_bypass"] <= rates["belady"]
    # an admission replaces the step's read over the link: the experts read there are the misses
    assert abs(result["link_experts_per_layer_step"] - (1 - rates["decayed"]) * 8) < 1e-3


def test_a_policy_out_of_range_is_refused():
    for bad in ({"recency_decay": 1.0}, {"recency_decay": 0.0}, {"recency_weight": -1.0}, {"recency_weight": float("inf")},
                {"recency_keep": 1.0}, {"max_admit": 17}, {"hysteresis": 0.9}):
        with pytest.raises(ValueError, match="bad cache policy"):
            Policy(**bad)
    assert Policy(recency_weight=0.0).recency.weight == 0.0 and Policy().recency == (0.5, 200.0, 0.99)


def test_a_synth_checkpoints_profile_is_the_one_its_router_was_fitted_to():
    from glm53.tools.synth import presets, router, writer

    profile = sim.synth_profile("scaled")
    shape = presets.resolve("scaled", None)
    targets = writer.router_targets(shape, router.load_profile(writer.DEFAULT_PROFILE))
    assert profile.shape == (shape.moe_layers, shape.experts)
    shares = profile / profile.sum(axis=1, keepdims=True)
    assert np.allclose(shares, np.stack([targets[i] for i in shape.moe_layer_indices]), atol=1e-6)


def test_a_recorded_trace_replays_with_the_synth_profile_and_the_engines_slot_count(tmp_path):
    rng = np.random.default_rng(0)
    trace = np.stack([np.stack([rng.choice(288, 8, replace=False) for _ in range(12)]) for _ in range(20)])
    np.save(tmp_path / "trace.npy", trace)
    out = tmp_path / "sim.json"
    assert sim.main(["--trace", str(tmp_path / "trace.npy"), "--synth-preset", "scaled", "--slots", "384", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["slots"], result["picks"], result["profile"]) == (384, 20 * 12 * 8, "glm53 synth --preset scaled")
    np.save(tmp_path / "short.npy", trace[:, :4])
    with pytest.raises(SystemExit):  # 4 layers against the preset's 12
        sim.main(["--trace", str(tmp_path / "short.npy"), "--synth-preset", "scaled"])
    with pytest.raises(SystemExit):
        sim.main(["--synth-preset", "scaled"])
