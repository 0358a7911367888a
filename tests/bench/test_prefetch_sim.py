"""The prefetch replay's bench: the noisy predictor's recall, the step time model, and a smoke run of the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import cache_policy_sim, prefetch_sim as sim
from glm53.offload.prefetch_policy import Split


@pytest.fixture(scope="module")
def case():
    profile = cache_policy_sim.load_profile(cache_policy_sim.PROFILE)[:2]
    return profile, cache_policy_sim.make_trace(profile, steps=200, top_k=8, mode="iid", seed=5)


@pytest.mark.parametrize("recall", [0.0, 0.5, 0.7, 1.0])
def test_the_noisy_predictor_keeps_about_recall_of_the_true_picks_and_fills_with_other_experts(case, recall):
    profile, trace = case
    pred = sim.noisy_predictions(trace, profile, recall, width=10, seed=1)
    assert pred.shape == (200, 2, 10)
    assert all(len(set(row.tolist())) == 10 for row in pred.reshape(-1, 10))  # distinct experts
    hits = (trace[..., :, None] == pred[..., None, :]).any(axis=-1)  # [S, L, k]
    assert sim.measured_recall(trace, pred) == pytest.approx(recall, abs=0.03)
    # the entries that are true picks are exactly the kept ones: every other entry is a false positive
    true_entries = sum(np.isin(pred[t, l], trace[t, l]).sum() for t in range(200) for l in range(2))
    assert true_entries == hits.sum()
    assert np.array_equal(sim.noisy_predictions(trace, profile, recall, 10, seed=1), pred)  # deterministic


def test_a_prediction_narrower_than_top_k_is_refused(case):
    profile, trace = case
    with pytest.raises(ValueError):
        sim.noisy_predictions(trace, profile, 0.5, width=7, seed=0)


def test_the_step_time_is_t_fix_plus_the_link_bytes_and_the_copies_overlap_the_window(case):
    profile, trace = case
    consts = {"t_fix_ms": 5.0, "link_gbs": 50.0, "expert_bytes": 10_000_000, "window_ms": 0.4, "budget_bytes": 20_000_000}
    none = sim.run_config(trace, profile, Split(64), None, consts, sim.Policy())
    oracle = sim.run_config(trace, profile, Split(64, pool=2), trace, consts, sim.Policy())
    for row in (none, oracle):
        assert row["serial_ms"] == pytest.approx(5.0 + row["link_mb_per_step"] / 50.0, abs=2e-3)
    assert none["overlapped_ms"] == none["serial_ms"] and none["prefetch_hit_rate"] == 0.0
    # two copies a layer step (20 MB in 0.4 ms at 50 GB/s), all picked, all hidden: 2 layers x 2 x 10 MB = 40 MB
    assert oracle["copies_per_step"] == 4.0 and oracle["wasted_mb_per_step"] == 0.0
    assert oracle["serial_ms"] - oracle["overlapped_ms"] == pytest.approx(40 / 50.0, abs=2e-3)
    assert oracle["prefetch_hit_rate"] == pytest.approx(2 / 8, abs=1e-4)


def test_the_cli_reports_every_configuration_for_both_traces(tmp_path, capsys):
    out = tmp_path / "prefetch.json"
    assert sim.main(["--steps", "40", "--layers", "2", "--out", str(out)]) == 0
    assert "overlap bound" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["model"]["t_fix_ms"] == 5.10 and result["model"]["window_fits_experts"] == 2
    assert "cross-layer" in result["caveat"]
    for mode in ("iid", "drift"):
        rows = result["modes"][mode]["runs"]
        main_rows = {r["predictor"]: r for r in rows if not r.get("trade")}
        assert list(main_rows) == ["none", "oracle", "recall 0.5", "recall 0.7", "recall 0.9"]
        assert main_rows["none"]["speedup"] == 1.0
        assert main_rows["oracle"]["wasted_mb_per_step"] == 0.0 and main_rows["oracle"]["measured_recall"] == 1.0
        pf = [main_rows[f"recall {r}"]["prefetch_hit_rate"] for r in ("0.5", "0.7", "0.9")]
        assert 0 < pf[0] < pf[1] < pf[2] <= main_rows["oracle"]["prefetch_hit_rate"]
        assert len({r["hit_rate"] for r in rows if r["cache_slots"] == main_rows["oracle"]["cache_slots"]}) == 1
        assert all(r["cache_slots"] + r["pool"] * r["buffers"] == result["model"]["total_slots"] for r in rows)


def test_the_break_even_is_the_straddling_copys_overrun_over_a_miss():
    consts = {"link_gbs": 50.0, "copy_gbs": 50.0, "expert_bytes": 10_000_000, "window_ms": 0.15}
    be = sim.break_even(consts)  # 200 us a copy, one starts in 150 us and runs 50 us past it; a miss is 200 us
    assert (be["copies"], be["copy_us"], be["overrun_us"], be["chance"]) == (1, 200.0, 50.0, 0.25)
    assert sim.break_even({**consts, "window_ms": 0.4})["chance"] == 0.0  # two copies end exactly in the window


def test_the_threshold_is_where_every_bucket_above_clears_the_chance():
    rows = [{"score_from": s, "precision": p} for s, p in ((0.8, 0.1), (0.85, 0.3), (0.9, 0.2), (0.95, 0.5), (1.0, 0.9))]
    assert sim.threshold_for(rows, 0.25) == 0.95  # 0.85 clears but 0.9 above it does not
    assert sim.threshold_for(rows, 0.05) == 0.8 and sim.threshold_for(rows, 0.95) is None


def test_calibration_on_the_twins_finds_a_threshold_on_trained_and_none_on_random():
    consts = {"link_gbs": 50.2, "copy_gbs": 55.0, "expert_bytes": 9_470_000, "window_ms": 0.1319}
    result = sim.calibrate(["trained", "random"], layers=3, steps=300, width=16, seed=0, consts=consts, total=96,
                           min_count=100)
    trained, random = result["presets"]["trained"], result["presets"]["random"]
    assert trained["by_rank"][0] > 0.9 > random["by_rank"][0]  # the trained gate on the previous state predicts
    assert trained["threshold"] is not None and random["threshold"] is None
    assert result["recommended_min_score"] == trained["threshold"]
    assert random["at_recommended"]["gain_us_per_step"] < 0 < trained["gains"][0]["gain_us_per_step"]
