"""bench.ram_tier_sim: the tier sizes of the H200 runs, Belady's optimum on a stream worked out by hand, the replay
counting what a real RamTier over files reads and admits, and the tool end to end on short traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import ram_tier_sim as sim
from glm53.offload.cache import Policy
from glm53.offload.cache_policy import ReferenceCache
from glm53.offload.disk import DiskReader
from glm53.offload.host_store import HostStore
from glm53.offload.ram_tier import RamTier, TierPolicy, missed, plan
from tests.offload.test_disk import trellis_checkpoint
from tests.offload.test_ram_tier import EXPERTS, LAYERS, TOP_K, skewed, trace


def test_the_tier_sizes_are_those_of_the_h200_runs():
    # policy_slots of bench/results/2026-12-02-ram-tier-h200.json: the budget less one layer's window
    assert (sim.tier_slots(12, 288, 50), sim.tier_slots(12, 288, 25)) == (1440, 576)
    assert sim.tier_slots(12, 288, 100) == 12 * 288  # the whole store: no tier, nothing read from disk
    assert sim.tier_slots(12, 288, 5) == 0  # the window alone takes the budget


def one_layer(picks: list[int]) -> sim.MissStream:
    return sim.MissStream([[np.array([e])] for e in picks], 0.0, 0)


def test_belady_keeps_what_is_used_again_first_and_bypasses_what_is_not_used_again():
    profile = np.array([[4.0, 3.0, 2.0, 1.0]])  # one slot: expert 0 starts in it
    # 1: read, evicts 0 (used again later than 1); 2: read, bypassed (never again); 1: hit; 0: read, replaces 1; 0: hit
    assert sim.belady_reads(one_layer([1, 2, 1, 0, 0]), profile, vram_slots=0, slots=1) == 3
    # the first two slots go to VRAM: the tier's one slot starts with expert 2, and a -1 (held in VRAM) is no read
    stream = sim.MissStream([[np.array([2, -1])], [np.array([3, -1])], [np.array([2, -1])]], 0.0, 0)
    assert sim.belady_reads(stream, profile, vram_slots=2, slots=1) == 1


def test_the_replay_reads_and_admits_what_a_ram_tier_on_files_does(tmp_path):
    ckpt, _ = trellis_checkpoint(tmp_path / "ckpt", layers=LAYERS, experts=EXPERTS, seed=3)
    store = HostStore.scan(ckpt)
    profile, rng = skewed(5)
    picks = trace(profile, rng, 60)[:, :, 0]  # [steps, layers, top_k]: one row a step, as the traces are
    vram_slots, policy = 6, TierPolicy(decay=0.9, hysteresis=1.1, exclusive_after=4)  # fast: the trace is short
    vram = Policy(decay=0.9)
    stream = sim.vram_misses(picks, profile, vram_slots, vram)
    slots = plan(store, 24 * store.layout.block_bytes).policy_slots
    got = sim.replay_tier(stream, profile, TOP_K, vram_slots, slots, policy)
    given_up = 0
    with DiskReader(store.shard_files(), threads=2) as reader:
        tier = RamTier(store, reader, plan(store, 24 * store.layout.block_bytes))
        tier.start(profile, TOP_K, vram_slots, policy)
        cache = ReferenceCache.warm(profile, vram_slots, TOP_K, vram.decay, vram.recency, vram.warm_horizon)
        for step in picks:
            for layer, selected in enumerate(step):
                vram_held = cache.slot_of[layer].copy()
                in_ram = tier.policy.slot_of[layer] >= 0
                tier.step(layer, missed(selected, vram_held), vram_held)
                given_up += int((in_ram & (vram_held >= 0) & (tier.policy.slot_of[layer] < 0)).sum())
                cache.step(layer, selected, vram.decay, vram.hysteresis, vram.max_admit, vram.recency)
    assert got.admitted > 0 and got.reads > 0 and given_up > 0  # not vacuous: the tier gave up slots VRAM duplicated
    assert (tier.reads["disk"], tier.reads["admitted"]) == (got.reads, got.admitted)


def test_a_twins_replay_has_belady_below_every_policy_and_fewer_reads_with_more_slots():
    from bench.routing_stats import twin_from_settings

    profile = sim.synth_profile("scaled", 4)
    twin, _ = twin_from_settings("scaled", "trained", 0, 4)
    picks = twin.run(150, 0).picks
    vram = sim.engine_vram_policy()
    assert vram == Policy()  # nothing set: the defaults
    got = sim.simulate(picks, profile, 128, [50, 25], {"first": sim.FIRST_POLICY, "default": TierPolicy()}, vram)
    assert got["steps"] == 150 and 0.0 < got["vram_hit_rate"] < 1.0
    assert got["vram_misses_per_token"] == pytest.approx((1 - got["vram_hit_rate"]) * 4 * twin.top_k, abs=1e-2)
    half, quarter = got["by_share"]["50"], got["by_share"]["25"]
    assert (half["policy_slots"], quarter["policy_slots"]) == (288, 0)  # 25 %: the window alone
    for row in (half, quarter):
        assert 0 < row["belady_reads_per_token"] <= min(row[p]["disk_reads_per_token"] for p in ("first", "default"))
    # with no policy slot every distinct miss is read, whatever the policy
    assert quarter["first"]["disk_reads_per_token"] == quarter["default"]["disk_reads_per_token"] == quarter["belady_reads_per_token"]
    assert half["first"]["disk_reads_per_token"] < quarter["first"]["disk_reads_per_token"]


def test_the_tool_replays_a_recorded_trace_and_writes_its_json(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "trace.npy"
    np.save(path, np.stack([[rng.choice(288, 8, replace=False) for _ in range(12)] for _ in range(20)]))
    out = tmp_path / "sim.json"
    assert sim.main(["--trace", str(path), "--shares", "50", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == sim.SCHEMA and result["policies"]["default"] == json.loads(json.dumps(TierPolicy().__dict__))
    row = result["traces"]["trace"]["by_share"]["50"]
    assert row["policy_slots"] == 1440 and result["traces"]["trace"]["vram_slots"] == 12 * 32
    assert set(row) == {"policy_slots", "belady_reads_per_token", "first", "default", "shared", "exclusive-at-once",
                        "default+write-back", "exclusive-at-once+write-back"}
    assert result["policies"]["shared"] == {**result["policies"]["default"], "exclusive": False}
    assert result["policies"]["exclusive-at-once"] == {**result["policies"]["default"], "exclusive_after": 1}
    with pytest.raises(SystemExit, match="the profile is 12 x 288"):
        np.save(path, np.zeros((3, 4, 8), dtype=np.int64))
        sim.main(["--trace", str(path)])


def test_the_tool_takes_the_vram_policy_and_extra_policies_and_keeps_the_first_policy_fixed(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "trace.npy"
    np.save(path, np.stack([[rng.choice(288, 8, replace=False) for _ in range(12)] for _ in range(12)]))
    out = tmp_path / "sim.json"
    argv = ["--trace", str(path), "--shares", "25", "--out", str(out)]
    assert sim.main(argv + ["--policy", "fast=decay:0.99,vram_score:0.5"]) == 0
    result = json.loads(out.read_text())
    assert result["vram_policy"]["decay"] == Policy().decay
    # the tier's first policy is the VRAM cache's policy of then, not of now
    assert result["policies"]["first"] == {**TierPolicy().__dict__, "decay": 0.999, "hysteresis": 1.25, "recency_weight": 0.0, "vram_score": 0.0,
                                           "exclusive": False}
    assert result["policies"]["fast"] == {**TierPolicy().__dict__, "decay": 0.99, "vram_score": 0.5}
    assert "fast" in result["traces"]["trace"]["by_share"]["25"]
    assert sim.main(argv + ["--vram-decay", "0.999", "--vram-recency-weight", "800"]) == 0
    result = json.loads(out.read_text())
    assert (result["vram_policy"]["decay"], result["vram_policy"]["recency_weight"]) == (0.999, 800.0)
    with pytest.raises(SystemExit):
        sim.main(argv + ["--policy", "bad=decay:2"])  # TierPolicy refuses it: an argparse error


def test_a_window_splits_a_recorded_trace_into_compare_sized_replays_from_its_start_to_its_end(tmp_path):
    path = tmp_path / "engine.npy"
    np.save(path, np.arange(255 * 2 * 3).reshape(255, 2, 3))
    traces = sim.load_traces([path], [], 0, 0, 0, window=97)
    assert list(traces) == ["engine[0:97]", "engine[79:176]", "engine[158:255]"]
    assert all(t.shape == (97, 2, 3) for t in traces.values())
    np.testing.assert_array_equal(traces["engine[158:255]"][-1], np.load(path)[-1])
    assert list(sim.load_traces([path], [], 0, 0, 0, window=300)) == ["engine"]  # shorter than the window: whole


def test_the_search_ranks_against_both_baselines_and_forked_workers_agree():
    from bench.routing_stats import twin_from_settings

    profile = sim.synth_profile("scaled", 4)
    twin, _ = twin_from_settings("scaled", "trained", 0, 4)
    traces = {"twin": twin.run(60, 0).picks}
    # both baselines in the grid, and a policy of neither
    grid = {f: tuple(sorted({getattr(sim.FIRST_POLICY, f), getattr(TierPolicy(), f)})) for f in TierPolicy().__dict__}
    grid["decay"] += (0.9,)
    ranked = sim.search(traces, profile, 128, [50], Policy(), grid)
    assert len(ranked) == np.prod([len(v) for v in grid.values()]) and sorted(ranked, key=lambda r: (r["worst"] > 1.0, r["mean"], r["worst"])) == ranked
    for baseline in ("first", "default"):  # each baseline is in the grid: its own reads over its own
        policy = sim.FIRST_POLICY if baseline == "first" else TierPolicy()
        assert next(r for r in ranked if r["policy"] == policy.__dict__)[f"of_{baseline}"] == {"twin@50": 1.0}
    for r in ranked:  # over the fewer reads of the two baselines
        assert r["of_best_baseline"]["twin@50"] == pytest.approx(max(r["of_first"]["twin@50"], r["of_default"]["twin@50"]), rel=1e-3)
    assert sim.search(traces, profile, 128, [50], Policy(), grid, jobs=2) == ranked


def test_reads_ahead_count_the_guesses_the_next_step_reads_and_those_it_does_not():
    profile = np.array([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])  # one policy slot a layer: expert 0 of each
    none = np.full(4, -1, dtype=np.int32)  # nothing in VRAM
    # two steps: layer 1 misses expert 2, then expert 3; the guesses (layer 1's, made at layer 0) are 0 (in its slot:
    # skipped), 2, 3 at the first step and 1, 3 at the second
    stream = sim.MissStream([[np.array([0]), np.array([2])], [np.array([0]), np.array([3])]], 0.0, 0, vram=[[none, none]] * 2)
    guesses = np.array([[[0, 2, 3]], [[1, 3, 0]]])
    got = sim.read_ahead(stream, guesses, profile, 1, 0, 2, TierPolicy(hysteresis=100.0), counts=(1, 2))
    # n = 1: guess 2 (covered), then guess 1 (wasted); n = 2: 2 and 3 (one covered), then 1 and 3 (one covered)
    assert got == {1: {"reads": 2, "guessed": 2, "covered": 1}, 2: {"reads": 2, "guessed": 4, "covered": 2}}


def test_the_read_ahead_report_on_the_twins(capsys):
    assert sim.main(["--read-ahead", "1,2", "--twin", "trained", "--steps", "40", "--shares", "50"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["read_ahead"]
    one, two = row["by_share"]["50"]["1"], row["by_share"]["50"]["2"]
    assert row["routing"] == "trained" and one["disk_reads_per_token"] == two["disk_reads_per_token"] > 0
    assert 0 < one["covered_per_token"] <= two["covered_per_token"] and one["guessed_per_token"] < two["guessed_per_token"]
    assert 0 < one["precision"] <= 1 and one["recall"] <= two["recall"] <= 1
