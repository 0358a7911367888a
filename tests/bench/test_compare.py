"""bench/compare.py on the CPU: arguments, the arm order, the checkpoint key and facts, the VRAM limit of the
project arms, each arm's environment, timeouts that take the arm's whole process tree, and an arm subprocess
that fails (no exllamav3 here) being recorded as an error with its log, not ending the run."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
import time
from pathlib import Path

import pytest

from bench import compare, scoreboard


def test_defaults_are_the_full_run():
    args = compare.parse_args([])
    assert (args.preset, args.seed, args.repeat, args.decode_tokens, args.prefill) == ("scaled", 1, "stock-vram", 256, [512, 4096])
    assert args.arm_list == list(scoreboard.ARMS)
    assert compare.arm_sequence(args.arm_list, args.repeat) == [
        ("stock-vram", 1), ("stock-mcs", 1), ("stock-mcs-pa", 1), ("exact", 1), ("fast", 1), ("stock-vram", 2)]


def test_quick_is_a_small_tiny_run_without_repeat():
    args = compare.parse_args(["--quick", "--arms", "stock-vram,exact"])
    assert args.preset == "tiny" and args.repeat == "none" and args.decode_reps == 1 and args.decode_tokens == 64
    assert compare.arm_sequence(args.arm_list, args.repeat) == [("stock-vram", 1), ("exact", 1)]
    args = compare.parse_args(["--quick", "--decode-tokens", "128", "--repeat", "stock-vram", "--preset", "scaled"])
    assert (args.decode_tokens, args.repeat, args.preset, args.decode_reps) == (128, "stock-vram", "scaled", 1)


def test_arms_run_in_a_fixed_order_whatever_the_order_given():
    assert compare.arm_sequence(["fast", "stock-mcs", "exact"], "exact") == [("exact", 1), ("stock-mcs", 1), ("fast", 1), ("exact", 2)]


@pytest.mark.parametrize("argv", [["--arms", "stock-vram,turbo"], ["--arms", "stock-mcs", "--repeat", "exact"], ["--decode-tokens", "1"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        compare.parse_args(argv)


def test_cache_holds_the_longest_job_in_whole_pages():
    args = compare.parse_args(["--prefill", "512", "4096", "--decode-context", "512", "--decode-tokens", "256"])
    assert compare.cache_tokens(args) == 4352  # 4096 + 256, rounded up to pages
    args = compare.parse_args(["--prefill", "100", "--decode-context", "2000", "--decode-tokens", "300", "--streams",
                               "--chunk-size", "2048"])
    assert compare.cache_tokens(args) == 2560
    # never below the prefill chunk: the engine's load runs a chunk over the cache
    args = compare.parse_args(["--prefill", "512", "--decode-tokens", "192", "--streams"])
    assert compare.cache_tokens(args) == 4096
    # four streams share the cache's pages: 4 x (2000 + 300 + 256) + 256
    args = compare.parse_args(["--prefill", "100", "--decode-context", "2000", "--decode-tokens", "300", "--streams", "2", "4"])
    assert compare.cache_tokens(args) == 10496
    args = compare.parse_args(["--prefill", "512", "--long-context", "32768", "--decode-tokens", "256"])
    assert compare.cache_tokens(args) == 33280


def test_the_long_context_phase_sets_the_first_second_of_decode_against_the_second_half(monkeypatch):
    from bench import compare_arm

    # prefill 2 s; then 40 ms per token for 0.5 s (restoring the cache), then 10 ms per token
    times = [2.0 + 0.04 * i for i in range(13)] + [2.48 + 0.01 * i for i in range(1, 188)]
    monkeypatch.setattr(compare_arm, "run_job", lambda gen, ids, n: (0.0, times))
    elastic = [{"enter": 1, "exit": 1, "lent_bytes": 0, "restored_experts": 5, "realloc_failures": 0},
               {"enter": 2, "exit": 2, "lent_bytes": 7, "restored_experts": 35, "realloc_failures": 0}]
    snapshots = iter([{"cache": {"hits": 1, "elastic": e}} for e in elastic])
    loaded = compare_arm.Loaded(None, 150000, stats=lambda: next(snapshots))
    out = compare_arm.long_context_phase(loaded, {"long_context": 8192, "decode_tokens": 200, "seed": 1})
    assert out["prefill_tok_s"] == pytest.approx(4096) and out["tokens"] == 200
    assert out["second_half_tok_s"] == pytest.approx(100)
    assert 40 < out["first_second_tok_s"] < 70  # slower than steady: the slow start is visible
    assert out["first_8_token_gaps_ms"] == [40.0] * 8
    assert out["elastic"] == {"enter": 1, "exit": 1, "restored_experts": 30, "realloc_failures": 0, "lent_bytes": 7}


@pytest.mark.parametrize("name, short", [("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
                                         ("NVIDIA H100 80GB HBM3", "h10080gbhbm3"), ("Tesla V100-SXM2-16GB", "v100sxm216gb"), ("", "gpu")])
def test_gpu_short_name(name, short):
    assert compare.gpu_short_name(name) == short


def test_checkpoint_key_follows_what_makes_the_bytes():
    key = compare.checkpoint_key("scaled", 1, None)
    assert key == compare.checkpoint_key("scaled", 1, None) and len(key) == 12
    assert len({key, compare.checkpoint_key("scaled", 2, None), compare.checkpoint_key("scaled", 1, 6),
                compare.checkpoint_key("tiny", 1, None), compare.checkpoint_key("scaled", 1, None, calibrate_rounds=3),
                compare.checkpoint_key("scaled", 1, None, routing="trained")}) == 6


def test_project_vram_limit_leaves_the_cache_the_gpu_share_and_room_for_staging():
    routed = 12 * 288 * 9_437_184
    limit, source = compare.project_vram_limit_gb(34.6, 36_100_000_000, routed, 32 / 288, 1.0, 5.2)
    assert limit == pytest.approx(34.6 - (256 / 288) * routed / 1e9 + 1.0 + 5.2 + compare.CUDA_CONTEXT_GB)
    assert "stock-vram" in source and "staging" in source
    limit, source = compare.project_vram_limit_gb(None, 36_100_000_000, routed, 32 / 288, 1.5, 5.2)
    assert limit == pytest.approx(36.1 + 2.0 - (256 / 288) * routed / 1e9 + 1.5 + 5.2 + compare.CUDA_CONTEXT_GB)
    assert "checkpoint bytes" in source


def _write_shard(path: Path, tensors: dict[str, int]) -> None:
    header, offset = {}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def test_checkpoint_facts_from_config_headers_and_profile(tmp_path):
    cfg = {"text_config": {"n_routed_experts": 4, "num_experts_per_tok": 2, "mlp_layer_types": ["dense", "sparse", "sparse"]},
           "glm53_synth": {"preset": "tiny", "seed": 3}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    experts = {f"model.language_model.layers.{l}.mlp.experts.{e}.up_proj.trellis": 100 for l in (1, 2) for e in range(4)}
    _write_shard(tmp_path / "model.safetensors", {**experts, "model.language_model.layers.1.mlp.shared_experts.up_proj.trellis": 50})
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"model.language_model.layers.1.mlp": [6, 2, 1, 1], "model.language_model.layers.2.mlp": [1, 1, 1, 1]}))
    args = compare.parse_args(["--quick"])
    info = compare.checkpoint_info(tmp_path, stats, None, args, reused=False)
    assert (info["preset"], info["seed"], info["moe_layers"], info["experts"], info["top_k"]) == ("tiny", 3, 2, 4, 2)
    assert info["routed_expert_bytes"] == 800 and info["expert_bytes"] == 100
    assert info["gpu_experts"] == 1  # 32/288 of 4 experts, at least one
    assert info["profile_hit_rate"] == pytest.approx((0.6 + 0.25) / 2)
    assert info["bytes"] == (tmp_path / "model.safetensors").stat().st_size


def test_only_the_cpu_offload_arms_get_the_shim(tmp_path):
    stats = tmp_path / "stats.json"
    stats.write_text("{}")
    mcs = compare.arm_env("stock-mcs-pa", stats, tmp_path)
    assert mcs["PYTHONPATH"].split(os.pathsep)[:2] == [str(compare.SHIM_DIR), str(compare.REPO)]
    assert mcs["EXL3_MOE_CPU_PIN"] == "0" and mcs["EXL3_MOE_CPU_SPLIT_STATS"] == str(stats)
    vram = compare.arm_env("stock-vram", stats, tmp_path)
    assert str(compare.SHIM_DIR) not in vram["PYTHONPATH"] and "EXL3_MOE_CPU_SPLIT_STATS" not in vram
    for key in ("XDG_CACHE_HOME", "XDG_DATA_HOME"):  # no learned placement leaks between arms
        assert vram[key] != mcs[key] and Path(vram[key]).parent == tmp_path


def test_a_cold_triton_run_gives_every_arm_an_empty_cache_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/kit/triton")
    assert compare.arm_env("exact", None, tmp_path)["TRITON_CACHE_DIR"] == "/kit/triton"  # the machine's, by default
    a, b = (Path(compare.arm_env(arm, None, tmp_path, cold_triton=True)["TRITON_CACHE_DIR"]) for arm in ("exact", "stock-vram"))
    assert a != b and a.parent == tmp_path and not any(a.iterdir()) and not any(b.iterdir())


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_timeout_kills_the_arm_and_what_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
            "time.sleep(60)")
    rc, seconds = compare.run_process([sys.executable, "-c", code], dict(os.environ), tmp_path / "arm.log", timeout=2)
    assert rc is None and seconds < 10
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


FIXTURE = Path(__file__).parent / "fixtures" / "compare-results.json"


def test_a_failing_arm_is_recorded_with_its_log(tmp_path):
    if importlib.util.find_spec("exllamav3") is not None:
        pytest.skip("exllamav3 is installed: the arm would really run")
    args = compare.parse_args(["--quick"])
    spec = {**compare.measurement_spec(args, tmp_path), "mcs": 14}
    logs = tmp_path / "logs"
    logs.mkdir()
    entry = compare.run_arm("stock-vram", 1, spec, None, tmp_path, logs, timeout=120)
    assert entry["name"] == "stock-vram" and entry["run"] == 1 and entry["status"] == "error"
    assert "No module named 'exllamav3'" in entry["error_tail"]  # the traceback of the arm
    assert (logs / entry["log"]).is_file()
    doc = json.loads(FIXTURE.read_text())
    doc["arms"] = [entry]
    assert scoreboard.validate(scoreboard.finish(doc)) == []


def test_a_whole_run_with_stand_in_arms(tmp_path, monkeypatch, capsys):
    """main() from the arguments to the results file, the arms replaced by stand-ins (the GPU parts)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = {"text_config": {"n_routed_experts": 4, "num_experts_per_tok": 2, "mlp_layer_types": ["dense", "sparse", "sparse"]},
           "glm53_synth": {"preset": "tiny", "seed": 1}}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _write_shard(ckpt / "model.safetensors", {f"model.language_model.layers.{l}.mlp.experts.{e}.up_proj.trellis": 1000
                                              for l in (1, 2) for e in range(4)})
    stats = ckpt / "routing-stats.json"
    stats.write_text(json.dumps({"model.language_model.layers.1.mlp": [6, 2, 1, 1], "model.language_model.layers.2.mlp": [4, 3, 2, 1]}))
    monkeypatch.setattr(compare, "prepare_checkpoint", lambda args: (ckpt, stats, True))
    monkeypatch.setattr(compare, "machine_info", lambda: {"gpu": "NVIDIA H200", "gpu_memory_gb": 150.0, "driver": "1", "cpu": "cpu",
                                                         "cores_logical": 4, "cores_physical": 2, "ram_gb": 16.0})
    monkeypatch.setattr(compare, "bandwidth", lambda *a: {"pcie_h2d_gbs": 50.0, "pcie_zero_copy_read_gbs": 40.0, "dram_read_gbs": 80.0,
                                                          "dram_threads": 2, "hbm_copy_gbs": 3000.0})
    seen = []
    rates = {"stock-vram": 200.0, "stock-mcs": 40.0, "stock-mcs-pa": 35.0, "exact": 50.0}

    def fake_arm(arm, run, spec, stats_path, work, logs, timeout, cold_triton=False):
        seen.append((arm, run, spec.get("vram_limit_gb"), spec["mcs"]))
        if arm == "fast":
            return {"name": arm, "run": run, "status": "not available", "reason": "NotImplementedError: no CPU tier", "seconds": 1.0}
        return {"name": arm, "run": run, "status": "ok", "seconds": 2.0, "load_seconds": 1.0, "decode_tok_s": rates[arm] - run,
                "decode_runs": [rates[arm]], "prefill_tok_s": {"512": 100.0, "4096": 900.0}, "hit_rate": 0.5 if arm == "exact" else None,
                "oracle_hit_rate": 0.6 if arm == "exact" else None, "host_rss_peak_gb": 2.0, "host_rss_steady_gb": 1.5,
                "vram_max_allocated_gb": 10.0 if arm == "stock-vram" else 3.0, "vram_device_used_gb": 11.0}

    monkeypatch.setattr(compare, "run_arm", fake_arm)
    assert compare.main(["--quick", "--repeat", "stock-vram", "--out-dir", str(tmp_path / "out"), "--name", "run"]) == 0
    results = json.loads((tmp_path / "out" / "run.json").read_text())
    assert scoreboard.validate(results) == []
    assert [(a, r) for a, r, _, _ in seen] == [("stock-vram", 1), ("stock-mcs", 1), ("stock-mcs-pa", 1), ("exact", 1), ("fast", 1), ("stock-vram", 2)]
    assert all(mcs == 3 for *_, mcs in seen)  # 4 experts, 1 kept in VRAM
    exact_limit = next(limit for arm, _, limit, _ in seen if arm == "exact")
    # stock-vram peak - offloaded experts + exact's reserve + two 2.6 GB staging buffers + the CUDA context
    assert exact_limit == pytest.approx(10.0 - 0.75 * 8000 / 1e9 + 1.0 + 5.2 + compare.CUDA_CONTEXT_GB)
    assert results["checkpoint"]["profile_hit_rate"] == pytest.approx((0.6 + 0.4) / 2)
    assert results["bounds"]["hit_rate"] == 0.5 and results["spread"]["stock-vram"]["runs"] == 2
    assert next(a for a in results["arms"] if a["name"] == "stock-mcs")["placement"].startswith("hot-first")
    assert results["command"].startswith("source .gpu/prep.sh && python3 -m bench.compare --quick")
    out = capsys.readouterr().out
    assert "| exact | 49.0 |" in out and "exact (run 1): ok" in out


def test_project_args_reach_the_project_arms_engine_last(monkeypatch):
    from bench import compare_arm
    from glm53.engine.exl3 import backend

    args = compare.parse_args(["--project-args", "--ct-enable 1 --ec-cache-experts 50%"])
    spec = {**compare.measurement_spec(args, Path("/ckpt")), "cache_experts": 384, "vram_limit_gb": 15.0}
    assert spec["project_args"] == ["--ct-enable", "1", "--ec-cache-experts", "50%"]
    seen = {}

    class FakeBackend:
        def __init__(self, settings):
            seen["settings"] = settings
            self.generator, self.info, self.stats, self.close = None, type("I", (), {"vocab_size": 10})(), dict, lambda: None

    monkeypatch.setattr(backend, "Exl3Backend", FakeBackend)
    loaded = compare_arm.load_project("fast", spec)
    s = seen["settings"]
    assert s.mode == "fast" and s.ct_enable is True and s.ec_cache_experts == "50%"  # given last: wins over the share
    assert loaded.facts["engine_argv"][-4:] == spec["project_args"]


def test_the_project_arms_step_the_engine_as_the_server_does_and_measure_it_idle(monkeypatch):
    """Every step of a project arm goes through Exl3Backend.iterate (the CPU tier woken before it, its costs refreshed
    after: the live split the server runs), not exllamav3's generator alone."""
    from bench import compare_arm

    calls = []
    generator = type("G", (), {"enqueue": lambda self, job: calls.append(("enqueue", job)),
                               "num_remaining_jobs": lambda self: 0})()
    backend = type("B", (), {"generator": generator, "iterate": lambda self: calls.append("iterate") or [],
                             "offload": type("O", (), {"tier": None})()})()
    steps = compare_arm.EngineSteps(backend)
    steps.enqueue("job")
    assert steps.iterate() == [] and steps.num_remaining_jobs() == 0
    assert calls == [("enqueue", "job"), "iterate"]
    monkeypatch.setattr(compare_arm, "IDLE_S", 0.05)
    idle = compare_arm.idle_cpu_percent(backend)
    assert 0 <= idle["idle_cpu_percent_of_one_core"] < 100 and "cpu_tier_parked" not in idle


def test_thread_cpu_time_leaves_the_measurements_own_threads_out():
    import threading

    from bench import compare_arm

    stop, ids = threading.Event(), []

    def spin():
        ids.append(threading.get_native_id())
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        while not ids:
            pass
        a_all, a_rest = compare_arm.thread_cpu_seconds(), compare_arm.thread_cpu_seconds(exclude=ids)
        import time

        time.sleep(0.5)
        b_all, b_rest = compare_arm.thread_cpu_seconds(), compare_arm.thread_cpu_seconds(exclude=ids)
    finally:
        stop.set()
        t.join()
    spun = b_all - a_all
    assert spun > 0.05 and b_rest - a_rest < 0.5 * spun  # the spinning thread's time is what was left out
