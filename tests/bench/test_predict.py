"""bench.predict on results written here: the exact arm's rate from the all-VRAM step plus its misses' reads, a fast arm
from the tier's figures of its own phase, a run under the old limiters excluded from the band, and the band written
where ``glm53 plan`` reads it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bench import predict
from glm53 import cost_model as cm

FIXTURE = Path(__file__).parent / "fixtures" / "compare-results.json"


def _results(tmp_path: Path) -> Path:
    base = json.loads(FIXTURE.read_text())
    fast = copy.deepcopy(base)
    fast["link_emulation"] = {"target_gbs": 25.0}
    arm = next(a for a in fast["arms"] if a["name"] == "fast")
    tier = {"costs": {"cpu_expert_us": {"1": 300.0, "4": 450.0}, "cpu_job_us": {"1": 200.0, "4": 200.0}, "handoff_us": 20.0,
                      "vram_expert_us": 2.0, "gpu_fixed_us": 80.0}, "split": {"misses": 1000, "cpu_experts": 400}, "worth": {}}
    arm.update(status="ok", decode_tok_s=50.0, decode_runs=[50.0], hit_rate=0.4, decode_phases={"1": {"hit_rate": 0.4, "cpu_tier": tier}})
    limited = copy.deepcopy(base)
    limited["link_limiter"] = {"target_read_gbs": 25.0}
    out = tmp_path / "results"
    out.mkdir(parents=True)
    for name, doc in (("a.json", base), ("b.json", fast), ("c.json", limited)):
        (out / name).write_text(json.dumps(doc))
    return out


def test_each_arm_is_predicted_from_its_runs_inputs_and_the_band_leaves_the_old_limiters_out(tmp_path, monkeypatch):
    replay = predict.Replay(_results(tmp_path), cm.load_profile(cm.PROFILE))
    rows = {(r["file"], r["arm"], r["streams"]): r for r in replay.rows()}
    exact = rows[("a.json", "exact", 1)]
    B, fixed = 9437184.0, 1 / 207.0  # the file's first all-VRAM run
    want = 1 / (fixed + 12 * 8 * (1 - 0.42) * B / 51e9)
    assert exact["predicted_tok_s"] == pytest.approx(want, rel=1e-3) and exact["ratio"] == pytest.approx(55.0 / want, rel=1e-3)
    fast = rows[("b.json", "fast", 1)]
    costs = cm.Costs({1: 300e-6, 4: 450e-6}, 20e-6, B / 25e9, 2e-6, cpu_job_s={1: 200e-6, 4: 200e-6}, gpu_fixed_s=80e-6)
    step = cm.Step(fixed_s=fixed, moe_layers=12, misses=8 * 0.6, hits=8 * 0.4)
    assert fast["predicted_tok_s"] == pytest.approx(1 / cm.fast_step_s(step, costs, predict.HOOK_GPU_S)[0], rel=1e-3)
    assert "the split sends" in fast["note"]
    assert rows[("c.json", "exact", 1)]["excluded"]
    summary = predict.summary(list(rows.values()))
    assert summary["excluded"] == 1 and summary["arms"] == 3  # a.json exact; b.json exact and fast
    band = tmp_path / "band.json"
    monkeypatch.setattr(cm, "ERROR_BAND", band)
    assert predict.main(["--results", str(_results(tmp_path / "again")), "--write-band"]) == 0
    assert json.loads(band.read_text())["arms"] == 3
