"""bench/extrapolate.py on the fixture run (12 MoE layers): the per-layer model's figures worked by hand, a measured
run set against them, and the refusals."""

from __future__ import annotations

import copy
import json

import pytest

from bench import extrapolate

from .tools import REPO

FIXTURE = REPO / "tests" / "bench" / "fixtures" / "compare-results.json"


@pytest.fixture
def base():
    return json.loads(FIXTURE.read_text())


def test_all_in_vram_grows_with_the_layers_and_an_offload_arm_adds_its_per_layer_time(base):
    p = extrapolate.predict(base, 42)
    t_v = 1 / 205.0  # stock-vram: the median of its two runs (207, 203)
    assert p["stock-vram"]["decode_tok_s"] == pytest.approx(1 / (t_v * 45 / 15), abs=0.01)
    t_exact = 1 / 55.0
    assert p["exact"]["decode_tok_s"] == pytest.approx(1 / (t_v * 3 + 42 * (t_exact - t_v) / 12), abs=0.01)
    t_v4096, t_mcs4096 = 4096 / 6470.0, 4096 / 1143.0  # prefill: a prompt's time
    assert p["stock-mcs"]["prefill_tok_s"]["4096"] == pytest.approx(4096 / (t_v4096 * 3 + 42 * (t_mcs4096 - t_v4096) / 12), abs=0.1)
    layer_gb = 288 * 9437184 / 1e9  # one copy of a layer's routed experts
    assert p["exact"]["host_rss_peak_gb"] == pytest.approx(33.0 + 30 * layer_gb, abs=0.01)
    assert p["stock-mcs-pa"]["host_rss_peak_gb"] == pytest.approx(62.0 + 2 * 30 * layer_gb, abs=0.01)  # two copies
    assert p["stock-vram"]["host_rss_peak_gb"] == 3.1  # its experts are in VRAM
    assert p["fast"] == {"decode_tok_s": None, "prefill_tok_s": {}, "host_rss_peak_gb": None}  # the arm did not run


def test_a_measured_run_is_set_against_the_prediction_and_a_run_of_another_size_is_refused(base, tmp_path):
    predicted = extrapolate.predict(base, 22)
    measured = copy.deepcopy(base)
    measured["checkpoint"]["moe_layers"] = 22
    for arm in measured["arms"]:
        if arm["name"] == "exact":
            arm["decode_tok_s"] = 2 * predicted["exact"]["decode_tok_s"]
    result = extrapolate.report(FIXTURE, base, 22, tmp_path / "m.json", measured)
    assert result["against"]["exact"]["decode_tok_s"]["ratio"] == 2.0
    assert result["against"]["fast"]["decode_tok_s"] == {"predicted": None, "measured": None, "ratio": None}
    with pytest.raises(ValueError, match="a run of 12 MoE layers, not 22"):
        extrapolate.report(FIXTURE, base, 22, FIXTURE, base)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(measured))
    assert extrapolate.main(["--base", str(FIXTURE), "--moe-layers", "22", "--measured", str(path), "--out", str(tmp_path / "o.json")]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["against"]["exact"]["decode_tok_s"]["ratio"] == 2.0
    assert extrapolate.main(["--base", str(tmp_path / "missing.json"), "--moe-layers", "22"]) == 2
