"""``glm53 plan``: the table for a preset, a described rig and this host (its measurements stood in for), as text and
JSON, with what bounds each mode and what the original project's figures would take."""

from __future__ import annotations

import json

import pytest

from glm53 import cli, plan
from glm53 import cost_model as cm


def test_the_original_projects_rig_shows_its_published_figures_and_what_its_fast_mode_would_take(capsys):
    assert cli.main(["plan", "--preset", "anchor-3090-epyc7443p"]) == 0
    out = capsys.readouterr().out
    assert "| exact | " in out and "| fast (picked) | " in out and "fast_tok_s 28.15" in out
    assert "30.96 tok/s (1.1x its fast mode) needs the CPU tier" in out and "of this rig's DRAM read rate" in out
    assert "projected" in out and "cpu_expert_s: this project's AVX2 int16 rate" in out


def test_a_described_rig_as_json(capsys):
    argv = ["plan", "--gpu", "RTX 4090", "--link-gbs", "12.5", "--cores", "24", "--isa", "avx512", "--dram-gbs", "80", "--ram-gib", "256",
            "--json"]
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["rig"]["link_gbs"] == 12.5 and r["rig"]["hbm_gbs"] == 1008 and r["pick"] == "fast"
    assert r["fits_in_ram"] == {"exact": True, "fast": True} and r["projection"]["ram_tier"] is None  # 256 GiB hold them all
    p = r["projection"]
    assert p["decode_tok_s"]["fast"]["1"] > 1.5 * p["decode_tok_s"]["exact"]["1"]


def test_this_host_from_its_measurements(monkeypatch, capsys):
    monkeypatch.setattr(plan, "local_cpu_figures", lambda: ({1: 250e-6, 4: 400e-6}, {1: 200e-6, 4: 200e-6}, 15, "avx512vbmi"))
    monkeypatch.setattr(plan, "dram_read_gbs", lambda: 70.0)
    monkeypatch.setattr(plan.host, "query_gpus", lambda: [plan.host.Gpu(0, "GPU-a", "NVIDIA GeForce RTX 4090", int(25.8e9), int(25e9),
                                                                         "595.71.05", "8.9", pcie_gen=4, pcie_width=16)])
    rig = plan.local_rig()
    assert rig.cores == 16 and rig.link_gbs == pytest.approx(25.6) and rig.vram_gb == 24.0 and rig.dram_gbs == 70.0
    assert rig.cpu_expert_s == {1: 250e-6, 4: 400e-6} and rig.sources["cpu_expert_s"].startswith("timed here")
    monkeypatch.setattr(plan.host, "query_gpus", lambda: [])
    assert "no GPU found" in plan.local_rig().sources["link_gbs"]


def test_a_bad_figure_is_refused_with_what_is_accepted(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--isa", "neon"])
    assert "invalid choice: 'neon'" in capsys.readouterr().err


def test_the_error_band_is_shown_once_bench_predict_has_written_it(monkeypatch, tmp_path, capsys):
    band = tmp_path / "band.json"
    band.write_text(json.dumps({"arms": 40, "within_10pct": 37, "median_abs_error": 0.03, "p90_abs_error": 0.08}))
    monkeypatch.setattr(cm, "ERROR_BAND", band)
    assert cli.main(["plan", "--preset", "h200-test-host"]) == 0
    assert "projected ± 8 % (bench.predict: 37 of 40 recorded arms within 10 %)" in capsys.readouterr().out


def test_a_host_short_of_ram_is_projected_with_a_ram_tier_read_from_disk_at_the_rate_given(capsys):
    base = ["plan", "--preset", "pcie4-4090-7950x", "--json"]
    runs = {}
    for name, extra in {"full": [], "64": ["--ram-gib", "64"], "64_slow": ["--ram-gib", "64", "--disk-gbs", "1.5"]}.items():
        assert cli.main(base + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out)["projection"]
    assert runs["full"]["ram_tier"] is None  # 128 GiB holds every expert: the host store as today
    tier, slow = runs["64"]["ram_tier"], runs["64_slow"]["ram_tier"]
    assert tier["disk_gbs"] == 7.0 and slow["disk_gbs"] == 1.5 and 0.5 < tier["ram_share"] < 0.7
    assert 0 < tier["disk_misses_per_layer"]["1"] < tier["disk_misses_per_layer"]["4"] < 8
    exact = {k: r["decode_tok_s"]["exact"]["1"] for k, r in runs.items()}
    assert exact["full"] > exact["64"] > exact["64_slow"]
    # the RAM tier's share of a token: 42 layers x (the disk misses x 9.44 MB at the rate + its host work a layer)
    per_token = {k: 1 / exact[k] for k in exact}
    disk_7, disk_1_5 = (42 * (t["disk_misses_per_layer"]["1"] * 9.44e6 / (r * 1e9) + cm.TIER_LAYER_S) for t, r in ((tier, 7.0), (slow, 1.5)))
    assert per_token["64"] - per_token["full"] == pytest.approx(disk_7, rel=1e-6)
    assert per_token["64_slow"] - per_token["full"] == pytest.approx(disk_1_5, rel=1e-6)
    # beside a RAM tier fast mode's CPU tier still takes its share of the misses (where the RAM tier holds them or read
    # them), from a RAM tier its copies make smaller: more disk reads, and still faster than exact mode on this rig
    fast_tier = tier["fast"]
    assert fast_tier["ram_slots_per_layer"] < tier["ram_slots_per_layer"] and fast_tier["ram_share"] < tier["ram_share"]
    assert fast_tier["disk_misses_per_layer"]["1"] > tier["disk_misses_per_layer"]["1"]
    assert runs["64"]["cpu_experts_per_layer"]["1"] > 0
    assert runs["full"]["decode_tok_s"]["fast"]["1"] > runs["64"]["decode_tok_s"]["fast"]["1"] > runs["64"]["decode_tok_s"]["exact"]["1"]
    assert runs["64_slow"]["decode_tok_s"]["fast"]["1"] < runs["64"]["decode_tok_s"]["fast"]["1"]
    assert runs["64_slow"]["prefill_tok_s"]["exact"] < runs["64"]["prefill_tok_s"]["exact"] < runs["full"]["prefill_tok_s"]["exact"]
    assert cli.main(["plan", "--preset", "pcie4-4090-7950x", "--ram-gib", "64"]) == 0
    out = capsys.readouterr().out
    assert "RAM tier: 64 GiB of host RAM; exact mode holds" in out and "fast mode's CPU tier computes its share" in out
