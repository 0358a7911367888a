"""bench/scoreboard.py: the results schema, the bound arithmetic, spread, ratios and goals, on a fixture run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bench import scoreboard

FIXTURE = Path(__file__).parent / "fixtures" / "compare-results.json"
EXPERT = 9_437_184


@pytest.fixture
def results() -> dict:
    return scoreboard.finish(json.loads(FIXTURE.read_text()))


def test_the_fixture_is_valid(results):
    assert scoreboard.validate(results) == []


@pytest.mark.parametrize("edit, problem", [
    (lambda r: r.pop("machine"), "machine is missing or not an object"),
    (lambda r: r["checkpoint"].pop("expert_bytes"), "checkpoint.expert_bytes is missing"),
    (lambda r: r.update(schema="other/2"), "schema is 'other/2'"),
    (lambda r: r["arms"][0].update(name="turbo"), "arms[0] (turbo): unknown arm name"),
    (lambda r: r["arms"][0].update(status="fine"), "status 'fine' is not one of"),
    (lambda r: r["arms"][1].pop("prefill_tok_s"), "arms[1] (stock-mcs): prefill_tok_s is missing"),
    (lambda r: r["arms"][1].update(decode_tok_s=0), "decode_tok_s must be a positive number"),
    (lambda r: r["arms"][4].pop("reason"), "arms[4] (fast): status not available without a reason"),
])
def test_validation_names_the_problem(results, edit, problem):
    broken = copy.deepcopy(results)
    edit(broken)
    assert any(problem in p for p in scoreboard.validate(broken)), scoreboard.validate(broken)


def test_decode_bound_by_hand():
    b = scoreboard.decode_bound(1 / 200, 0.3, 8, 12, EXPERT, 50.0)
    miss = 0.7 * 8 * 12 * EXPERT
    assert b["miss_bytes_per_token"] == pytest.approx(miss)
    assert b["seconds_per_token"] == pytest.approx(0.005 + miss / 50e9)
    assert b["tok_s"] == pytest.approx(1 / (0.005 + miss / 50e9))
    assert scoreboard.decode_bound(1 / 200, 1.0, 8, 12, EXPERT, 50.0)["tok_s"] == pytest.approx(200)


def test_bounds_use_the_exact_arm_hit_rate_and_the_zero_copy_link(results):
    b = results["bounds"]
    allvram = (207.0 + 203.0) / 2
    assert b["available"] and b["hit_rate"] == 0.42 and b["hit_rate_source"].startswith("exact arm")
    assert b["link"] == "pcie_zero_copy_read_gbs" and b["link_gbs"] == 51.0
    assert b["t_allvram_ms"] == pytest.approx(1000 / allvram)
    assert b["exact"]["tok_s"] == pytest.approx(1 / (1 / allvram + 0.58 * 8 * 12 * EXPERT / 51e9))
    assert b["exact_oracle"]["tok_s"] == pytest.approx(1 / (1 / allvram + 0.53 * 8 * 12 * EXPERT / 51e9))
    assert b["fast_dram"]["tok_s"] == pytest.approx(1 / (1 / allvram + 0.58 * 8 * 12 * EXPERT / (51e9 + 93e9)))
    assert b["exact"]["tok_s"] < b["exact_oracle"]["tok_s"] < b["fast_dram"]["tok_s"]
    assert "fast" not in b  # the fast arm did not run: no CPU-tier figure


def _with_fast_arm(results, decode: float, cpu_expert_us: float, hit_rate: float = 0.45) -> dict:
    r = copy.deepcopy(results)
    fast = next(a for a in r["arms"] if a["name"] == "fast")
    exact = next(a for a in r["arms"] if a["name"] == "exact")
    fast.clear()
    fast.update({**copy.deepcopy(exact), "name": "fast", "decode_tok_s": decode, "decode_runs": [decode], "hit_rate": hit_rate,
                 "engine_stats": {"offload": {"cpu_tier": {"costs": {"cpu_expert_us": {"1": cpu_expert_us, "2": 2 * cpu_expert_us}}}}}})
    return scoreboard.finish(r)


def test_the_fast_bound_adds_the_cpu_tiers_measured_rate_capped_by_dram(results):
    allvram = (207.0 + 203.0) / 2
    r = _with_fast_arm(results, 70.0, 600.0)
    cpu = EXPERT / 600e-6 / 1e9  # 15.7 GB/s
    b = r["bounds"]["fast"]
    assert b["cpu_tier_gbs"] == pytest.approx(cpu) and b["miss_gbs"] == pytest.approx(51.0 + cpu) and b["hit_rate"] == 0.45
    assert b["tok_s"] == pytest.approx(1 / (1 / allvram + 0.55 * 8 * 12 * EXPERT / ((51.0 + cpu) * 1e9)))
    capped = _with_fast_arm(results, 70.0, 100.0)["bounds"]["fast"]  # 94 GB/s of CPU: the DRAM rate caps the sum
    assert capped["miss_gbs"] == 93.0
    goals = {g["goal"]: g for g in r["goals"]}
    exact = scoreboard.arm_value(r, "exact", "decode_tok_s")
    assert goals["fast decode / exact decode (full link)"]["ratio"] == pytest.approx(70.0 / exact)
    assert goals["fast decode / exact decode (full link)"]["target"] == 1.15
    assert goals["fast decode / fast bound (full link)"]["ratio"] == pytest.approx(70.0 / b["tok_s"])
    assert not any("best stock offload" in name and "fast" in name for name in goals)


def test_the_fast_goals_follow_the_runs_conditions(results):
    r = _with_fast_arm(results, 70.0, 600.0)
    emulated = scoreboard.finish({**copy.deepcopy(r), "link_emulation": {"target_gbs": 25.0}})
    goals = {g["goal"]: g for g in emulated["goals"]}
    assert goals["fast decode / exact decode (link emulated at 25 GB/s)"]["target"] == 1.4
    assert goals["fast decode / best stock offload decode (link emulated at 25 GB/s)"]["target"] == 2.0
    assert goals["fast decode / fast bound (link emulated at 25 GB/s)"]["target"] == 0.8
    # the bounds are the emulated link's
    assert emulated["bounds"]["link"] == "emulated" and emulated["bounds"]["link_gbs"] == 25.0
    slower = scoreboard.finish({**copy.deepcopy(r), "link_emulation": {"target_gbs": 12.5}})
    assert {g["goal"]: g for g in slower["goals"]}["fast decode / exact decode (link emulated at 12.5 GB/s)"]["target"] == 1.8
    hogged = scoreboard.finish({**copy.deepcopy(r), "cpu_hog": {"cpus": [0, 1]}})
    goals = {g["goal"]: g for g in hogged["goals"]}
    assert goals["fast decode / exact decode (CPU hog)"]["target"] == 0.98
    # batched streams: fast at least exact at every count both arms measured
    streamed = copy.deepcopy(r)
    for arm, rates in (("exact", {"2": 60.0, "4": 80.0}), ("fast", {"2": 66.0, "4": 79.0})):
        next(a for a in streamed["arms"] if a["name"] == arm and a["status"] == "ok")["decode_streams_tok_s"] = rates
    goals = {g["goal"]: g for g in scoreboard.finish(streamed)["goals"]}
    assert goals["fast / exact, 2 streams batched (full link)"]["met"] is True
    assert goals["fast / exact, 4 streams batched (full link)"]["met"] is False


def test_bounds_fall_back_to_the_profile_then_say_why_not(results):
    r = copy.deepcopy(results)
    r["arms"] = [a for a in r["arms"] if a["name"] != "exact"]
    r["bandwidth"]["pcie_zero_copy_read_gbs"] = None
    b = scoreboard.bounds(r)
    assert b["hit_rate"] == 0.37 and b["hit_rate_source"].startswith("routing profile")
    assert b["link"] == "pcie_h2d_gbs" and "exact_oracle" not in b
    r["checkpoint"]["profile_hit_rate"] = None
    assert scoreboard.bounds(r) == {"available": False, "reason": "no hit rate (no exact arm and no routing profile)"}
    r["arms"] = [a for a in r["arms"] if a["name"] != "stock-vram"]
    assert "stock-vram" in scoreboard.bounds(r)["reason"]


def test_spread_of_the_repeated_arm(results):
    s = results["spread"]
    assert list(s) == ["stock-vram"]
    assert s["stock-vram"]["runs"] == 2
    assert s["stock-vram"]["decode_tok_s"]["relative"] == pytest.approx(4 / 205)
    assert s["stock-vram"]["prefill_4096_tok_s"]["values"] == [6440.0, 6500.0]


def test_ratios_and_best_stock_offload(results):
    assert scoreboard.best_stock_offload(results) == ("stock-mcs", 45.7)
    assert scoreboard.best_stock_offload(results, "prefill_tok_s", 4096) == ("stock-mcs-pa", 1502.0)
    exact = next(a for a in results["arms"] if a["name"] == "exact")
    r = scoreboard.ratios(results, exact)
    assert r["vs_stock_offload"] == pytest.approx(55.0 / 45.7)
    assert r["vs_bound"] == pytest.approx(55.0 / results["bounds"]["exact"]["tok_s"])
    fast = next(a for a in results["arms"] if a["name"] == "fast")
    assert scoreboard.ratios(results, fast) == {"vs_stock_offload": None, "vs_bound": None}


def test_goals(results):
    g = {x["goal"]: x for x in results["goals"]}
    assert g["exact decode / best stock offload decode"]["ratio"] == pytest.approx(55.0 / 45.7)
    assert g["exact decode / best stock offload decode"]["met"] is True
    assert g["exact decode / exact bound"]["met"] is False
    assert g["exact prefill 4096 / stock all-VRAM prefill 4096"]["ratio"] == pytest.approx(4700 / 6470)
    assert g["exact prefill 512 / best stock offload prefill 512"]["ratio"] == pytest.approx(900 / 162)
    r = copy.deepcopy(results)
    r["arms"] = [a for a in r["arms"] if a["name"] != "exact"]
    assert all(x["ratio"] is None and x["met"] is None for x in scoreboard.goals(r))


def test_profile_hit_rate():
    stats = {"a": [5, 3, 1, 1], "b": [0, 0, 0, 0], "c": [1, 1, 1, 1]}
    assert scoreboard.profile_hit_rate(stats, 2) == pytest.approx((0.8 + 0.5) / 2)  # a layer without picks is left out
    with pytest.raises(ValueError):
        scoreboard.profile_hit_rate({"b": [0, 0]}, 1)


def test_the_prefetch_arms_goals_and_the_overlap_bound(results):
    b = results["bounds"]
    allvram = (207.0 + 203.0) / 2
    miss_s = 0.58 * 8 * 12 * EXPERT / 51e9
    assert b["exact_overlap"]["tok_s"] == pytest.approx(1 / max(1 / allvram, miss_s))
    assert b["exact_overlap"]["tok_s"] > b["exact"]["tok_s"]
    assert not [g for g in results["goals"] if "prefetch" in g["goal"] or "oracle" in g["goal"]]  # no such arm ran
    r = copy.deepcopy(results)
    exact = next(a for a in r["arms"] if a["name"] == "exact")
    for name, decode in (("exact-oracle", 1.35 * 55.0), ("exact-prefetch", 1.1 * 55.0)):
        r["arms"].append({**copy.deepcopy(exact), "name": name, "decode_tok_s": decode, "decode_runs": [decode]})
    r = scoreboard.finish(r)
    assert scoreboard.validate(r) == []
    g = {x["goal"]: x for x in r["goals"]}
    assert g["exact-oracle decode / exact decode"]["ratio"] == pytest.approx(1.35) and g["exact-oracle decode / exact decode"]["met"]
    assert g["exact-prefetch decode / exact decode"]["ratio"] == pytest.approx(1.1)
    assert g["exact-prefetch decode / exact decode"]["met"] is False
    assert g["exact-oracle (else exact-prefetch) decode / exact overlap bound"]["ratio"] == pytest.approx(1.35 * 55.0 / b["exact_overlap"]["tok_s"])
