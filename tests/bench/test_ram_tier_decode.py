"""bench/ram_tier_decode.py: the budget for a share of a checkpoint's experts, and the report's bound, ratios and goals
from the ram-tier phase's files."""

from __future__ import annotations

import json

import pytest

from bench import ram_tier_decode as rt
from glm53 import cost_model as cm
from glm53.config import GB
from glm53.offload.host_store import HostStore
from tests.offload.test_disk import trellis_checkpoint

B = 10_000_000  # an expert block's bytes in the fake runs


def arm(name, tok_s, prefill, misses, steps, disk=None, budget=None, rss=20.0, staged=None):
    offload = {"cache": {"decode_steps": steps, "misses": misses, "slot_bytes": B}}
    if staged is not None:  # (staged forwards, their disk reads)
        offload["staging"] = {"forwards": staged[0], "disk_experts": staged[1]}
    if disk is not None:
        offload["ram_tier"] = {"policy_slots": 10, "share_of_experts": 0.4, "served": {"disk": disk, "ram": 1},
                               "disk_gbs": {"start": 2.0, "serving": 0.5}, "read_seconds": 3.0,
                               "layers": {"decode_layers": 400, "other_layers": 100, "decode_wait_seconds": 0.2,
                                          "decode_tier_seconds": 2.6, "rehome_seconds": 0.05},
                               "decode": {"policy_seconds": 0.4, "read_seconds": 2.0, "read_experts": 200, "read_gbs": 1.0}}
    return {"name": name, "status": "ok", "decode_tok_s": tok_s, "prefill_tok_s": {"4096": prefill},
            "engine_stats": {"offload": offload}, "settings": {"host_ram_gb": budget}, "host_rss_peak_gb": rss}


@pytest.fixture
def run_dir(tmp_path):
    bandwidth = {"pcie_zero_copy_read_gbs": 50.0}
    (tmp_path / "compare-ram-100.json").write_text(json.dumps({"bandwidth": bandwidth, "arms": [
        arm("stock-vram", 100.0, 5000.0, 0, 1), arm("exact", 60.0, 1000.0, misses=500, steps=100)]}))
    (tmp_path / "compare-ram-50.json").write_text(json.dumps({"arms": [
        arm("exact", 20.0, 800.0, misses=500, steps=100, disk=200, budget=18.0, rss=23.0, staged=(2, 3000))]}))
    (tmp_path / "disk-bw.json").write_text(json.dumps({"gbs_by_reads_in_flight": {"o_direct": {"4": {"best_gbs": 1.0}}}}))
    return tmp_path


def test_the_report_bounds_each_budget_by_its_link_and_disk_reads(run_dir):
    out = rt.report(run_dir)
    full, half = out["by_ram_share"]["100"], out["by_ram_share"]["50"]
    assert out["t_fix_ms"] == 10.0 and out["w_disk_gbs"] == 1.0
    # full RAM: 5 host reads a token x 10 MB / 50 GB/s = 1 ms, under T_fix = 10 ms: the bound is 100 tok/s
    assert full["bound_tok_s"] == 100.0 and full["of_bound"] == 0.6 and full["disk_reads_per_token"] == 0
    # half: 1 ms over the link + 2 disk reads x 10 MB / 1 GB/s (disk_bw's, faster than the tier's own 0.5) = 20 ms
    assert half["w_disk_gbs"] == 1.0
    assert half["bound_tok_s"] == round(1 / 0.021, 2) and half["of_bound"] == round(20.0 * 0.021, 3)
    assert half["decode_vs_full_ram"] == round(20 / 60, 3) and half["prefill_vs_full_ram"] == 0.8
    # prefill: a staged forward read 1,500 experts x 10 MB at 1 GB/s = 15 s, longer than full RAM's 4096 / 1000 tok/s
    assert half["prefill_disk_s"] == 15.0 and half["prefill_bound_tok_s"] == round(4096 / 15, 1)
    assert half["prefill_of_bound"] == round(800 / (4096 / 15), 3)
    assert half["rss_allowed_gb"] == round(18.0 + cm.PROCESS_OVERHEAD / GB, 2) and half["rss_within_budget_plus_overhead"]
    # a decode layer's host time: 400 layers; the step's 2.6 s less the policy's 0.4 and the reads' 2.0 leave 0.2
    assert half["decode_layer_ms"] == {"sync_wait": 0.5, "policy": 1.0, "placed_while_reading": 0.0, "disk_read": 5.0, "rest_of_step": 0.5,
                                       "rehome_all_layers": 0.1, "disk_read_gbs": 1.0}
    assert out["by_ram_share"]["25"] == {"status": "not run or failed"}
    goals = out["goals"]
    assert goals["decode_50_of_bound"]["met"] is False and goals["prefill_50_vs_full"]["met"] is True and goals["rss_50"]["met"]


def test_the_budget_for_a_share_is_that_share_of_the_blocks_and_never_below_one_layer(tmp_path):
    ckpt, _ = trellis_checkpoint(tmp_path / "ckpt", layers=(1, 2, 3, 4), experts=8)
    store = HostStore.scan(ckpt)
    assert rt.budget_gb(ckpt, 50) == pytest.approx(store.arena_bytes / 2 / GB)
    layer = 8 * store.layout.block_bytes
    assert rt.budget_gb(ckpt, 1) == pytest.approx((layer + store.layout.block_bytes // 2) / GB)


def test_the_policy_runs_side_by_side_say_each_runs_rate_reads_admissions_and_policy(tmp_path):
    runs = []
    for name, tok_s, disk, policy in (("new-1", 9.0, 1300, {"decay": 0.995}), ("old", 8.5, 1400, {"decay": 0.999})):
        a = arm("exact", tok_s, 300.0, misses=5800, steps=100, disk=disk, budget=16.3)
        a["engine_stats"]["offload"]["ram_tier"].update(policy=policy)
        a["engine_stats"]["offload"]["ram_tier"]["served"].update(admitted=250, ahead=120, ahead_used=90)
        a["settings"]["ram_tier_read_ahead"] = 2
        runs.append(tmp_path / f"compare-ram-policy-{name}.json")
        runs[-1].write_text(json.dumps({"arms": [a]}))
    (tmp_path / "compare-ram-policy-new-2.json").write_text(json.dumps({"arms": [arm("exact", 60.0, 1000.0, misses=500, steps=100)]}))
    out = rt.policy_runs(runs + [tmp_path / "compare-ram-policy-new-2.json", tmp_path / "missing.json"])
    assert out["runs"]["compare-ram-policy-new-1"] == {
        "arm": "exact", "decode_tok_s": 9.0, "disk_reads_per_token": 13.0, "host_reads_per_token": 58.0, "decode_steps": 100,
        "admissions_per_token": 2.5, "read_ahead_per_token": 1.2, "read_ahead_used_per_token": 0.9, "written_back_per_token": 0.0,
        "decode_layer_ms": {"sync_wait": 0.5, "policy": 1.0, "placed_while_reading": 0.0, "disk_read": 5.0, "rest_of_step": 0.5,
                            "rehome_all_layers": 0.1,
                            "disk_read_gbs": 1.0},
        "disk_gbs": {"start": 2.0, "serving": 0.5}, "settings": {"ram_tier_read_ahead": 2}, "policy": {"decay": 0.995}}
    assert out["runs"]["compare-ram-policy-old"]["disk_reads_per_token"] == 14.0
    assert out["runs"]["compare-ram-policy-new-2"]["status"].startswith("not run")  # no RAM tier in that run
    assert out["runs"]["missing"]["status"].startswith("not run")


def test_since_the_policy_runs_beside_the_reads_a_layer_s_disk_time_is_the_wait_after_it():
    tier = arm("exact", 9.0, 300.0, misses=5800, steps=100, disk=1300)["engine_stats"]["offload"]["ram_tier"]
    tier["decode"].update(wait_seconds=1.2, read_seconds=1.6)  # the reads took 1.6 s, 0.4 of them beside the policy
    got = rt.decode_layer_ms(tier)
    # 400 decode layers: the policy 1.0 ms, the wait after it 3.0, the rest of the tier's 2.6 s 2.5
    assert (got["policy"], got["disk_read"], got["rest_of_step"]) == (1.0, 3.0, 2.5)
    tier["decode"]["placed_seconds"] = 0.08  # since the tables are pointed while the reads are in flight: apart
    got = rt.decode_layer_ms(tier)
    assert (got["placed_while_reading"], got["disk_read"], got["rest_of_step"]) == (0.2, 3.0, 2.3)


def test_a_fast_run_beside_the_ram_tier_says_what_its_cpu_tier_took(tmp_path):
    fast = arm("fast", 11.0, 300.0, misses=5800, steps=100, disk=1300)
    fast["engine_stats"]["offload"]["cpu_tier"] = {"split": {"cpu_experts": 1500}, "state": "running",
                                                   "device": {"fallback_jobs": 3}, "repointed": 900}
    off = arm("fast", 9.0, 300.0, misses=5800, steps=100, disk=1300)
    off["engine_stats"]["offload"]["cpu_tier"] = {"off": "the measured costs give it no share of the misses"}
    for name, a in (("fast-1", fast), ("fast-2", off)):
        a["engine_stats"]["offload"]["ram_tier"]["served"].update(admitted=250)
        a["engine_stats"]["offload"]["ram_tier"]["policy"] = {"decay": 0.995}
        (tmp_path / f"compare-ram-fast-{name}.json").write_text(json.dumps({"arms": [a]}))
    out = rt.policy_runs(sorted(tmp_path.glob("compare-ram-fast-*.json")))["runs"]
    assert out["compare-ram-fast-fast-1"]["arm"] == "fast" and out["compare-ram-fast-fast-1"]["decode_tok_s"] == 11.0
    assert out["compare-ram-fast-fast-1"]["cpu_tier"] == {"experts_per_token": 15.0, "state": "running", "fallback_jobs": 3,
                                                         "repointed": 900}
    assert out["compare-ram-fast-fast-2"]["cpu_tier"] == {"off": "the measured costs give it no share of the misses"}
