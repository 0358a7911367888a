"""The soft-score replays: the signals from the router's logits, the soft term in the grid's replay, the gap split."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench import cache_policy_grid as grid
from bench import cache_policy_sim as sim
from bench import cache_policy_soft as soft
from bench.routing_stats import twin_from_settings
from glm53.offload.cache import Policy


@pytest.fixture(scope="module")
def tiny():
    """(twin, profile, run, start) of the tiny preset's trained twin: 5 MoE layers, 16 experts, top-4, 6 slots."""
    twin, profile = twin_from_settings("tiny", "trained", 2, None)
    run = twin.run(120, 1)
    return twin, profile, run, sim.starting_residents(profile, 6 * 5)


def test_the_normal_cdf_is_erfs_to_two_parts_in_ten_million():
    x = np.linspace(-6, 6, 241)
    want = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x])
    assert np.abs(soft.normal_cdf(x) - want).max() < 2e-7


def test_the_signals_mark_near_misses_and_stay_in_range(tiny):
    twin, _, run, _ = tiny
    biases = np.stack(twin.biases)
    rank = soft.soft_signal(run.logits, biases, 4, "rank", 7)
    assert (rank.sum(axis=2) == 3).all()  # ranks 4, 5, 6
    assert not np.take_along_axis(rank, run.picks, axis=2).any()  # the picks are not near misses
    margin = soft.soft_signal(run.logits, biases, 4, "margin", 0.02)
    assert (np.take_along_axis(margin, run.picks, axis=2) >= 0.5).all() and (margin <= 1).all()
    one, four = (soft.soft_signal(run.logits, biases, 4, "predict", n) for n in (1, 4))
    assert (one >= 0).all() and (one <= 1).all() and (four >= one).all() and (four <= 4).all()
    # a pick is more likely picked at the next step than the others are
    picked = np.take_along_axis(one, run.picks, axis=2).mean()
    assert picked > 2 * one.mean()
    with pytest.raises(ValueError, match="unknown soft signal"):
        soft.soft_signal(run.logits, biases, 4, "oracle", 0)


def test_a_soft_term_of_weight_zero_is_the_policy_and_the_hit_flags_add_up(tiny):
    twin, profile, run, start = tiny
    signal = soft.soft_signal(run.logits, np.stack(twin.biases), 4, "predict", 1)
    base = grid.replay(run.picks, start, profile, Policy(), record=True)
    zero = grid.replay(run.picks, start, profile, Policy(), grid.Soft(signal, 0.5, 0.0))
    for name in ("hits", "admits", "freq", "recent"):
        np.testing.assert_array_equal(base[name], zero[name])
    assert base["hit"].sum(axis=(0, 2)).tolist() == base["hits"].tolist()
    weighted = grid.replay(run.picks, start, profile, Policy(), grid.Soft(signal, 0.5, 8.0))
    assert not np.array_equal(weighted["admits"], base["admits"])  # the term moves decisions on a trained twin


def test_beladys_hit_flags_are_its_hits(tiny):
    _, _, run, start = tiny
    flags = np.zeros(run.picks.shape, dtype=bool)
    assert sim.run_belady(run.picks, start, hit=flags) == int(flags.sum()) == sim.run_belady(run.picks, start)


def test_the_gap_splits_beladys_advantage_over_classes_of_picks(tiny):
    twin, profile, run, start = tiny
    policy = grid.replay(run.picks, start, profile, Policy(), record=True)["hit"]
    belady = np.zeros(run.picks.shape, dtype=bool)
    sim.run_belady(run.picks, start, hit=belady)
    got = soft.gap(run.picks, policy, belady, soft.selection_scores(run.logits, np.stack(twin.biases)))
    assert got["gap_hit_rate"] == round((belady.sum() - policy.sum()) / run.picks.size, 4)
    by_reuse = ["first", "reuse_1_1", "reuse_2_4", "reuse_5_16", "reuse_17_64", "reuse_65_plus"]
    assert sum(got[c]["share_of_picks"] for c in by_reuse) == pytest.approx(1.0, abs=1e-3)
    assert sum(got[c]["share_of_gap"] for c in by_reuse) == pytest.approx(1.0, abs=5e-3)
    by_rank = [c for c in got if c.startswith("prev_rank")]
    assert sum(got[c]["share_of_picks"] for c in by_rank) == pytest.approx(1 - 1 / run.picks.shape[0], abs=1e-3)


def test_the_reuse_distance_counts_steps_since_the_last_pick():
    trace = np.array([[[1, 2]], [[3, 1]], [[2, 4]], [[1, 3]]])  # [steps, 1 layer, top-2]
    assert soft.reuse_distance(trace)[:, 0].tolist() == [[0, 0], [0, 1], [2, 0], [2, 2]]


def test_the_prefetch_ceiling_is_a_hit_rate_above_the_online_set(tiny):
    twin, _, run, start = tiny
    got = soft.online_ceiling(twin, run.logits, start, samples=32)
    assert 0 < got["lower"] <= got["upper"] <= 1


def test_a_recorded_engine_trace_is_replayed_with_its_own_logits_and_the_shipped_profile(tiny, tmp_path):
    """What ``bench.routing_stats --engine --trace-out --logits-out`` saves (here the tiny twin's trace and logits, as
    the engine's would be on a tiny checkpoint), replayed from the files through the CLI."""
    twin, _, run, _ = tiny
    picks, logits = tmp_path / "picks.npy", tmp_path / "logits.npz"
    np.save(picks, run.picks)
    np.savez_compressed(logits, logits=run.logits, biases=np.stack(twin.biases).astype(np.float32))
    out = tmp_path / "soft.json"
    assert soft.main(["--engine-trace", str(picks), str(logits), "--synth-preset", "tiny", "--slots", "30", "--out", str(out)]) == 0
    got = __import__("json").loads(out.read_text())
    assert got["trace"] == "engine" and got["steps"] == 120 and got["slots"] == 30
    assert got["hit_rate"]["belady"] >= max(r["hit_rate"] for r in got["runs"]) > 0
    assert {r["base"] for r in got["runs"]} == set(soft.BASES) and any(r["kind"] == "predict" for r in got["runs"])
    with pytest.raises(ValueError, match="do not match the trace's"):
        soft.run_recorded(run.picks[:-1], {"logits": run.logits, "biases": np.stack(twin.biases)}, "tiny", 30, "small")
