"""One arm of ``bench/compare.py``, in a process of its own: load the checkpoint the arm's way, measure, write JSON.

    python3 -m bench.compare_arm --arm stock-mcs --spec spec.json --result arm.json

Arms:

- ``stock-vram``: stock exllamav3, everything in VRAM;
- ``stock-mcs``: stock exllamav3's CPU offload, ``-mcs N`` (the N coldest experts of every layer on its CPU
  worker when ``EXL3_MOE_CPU_SPLIT_STATS`` names a routing profile; ``compare.py`` sets it, the core-order shim
  and ``EXL3_MOE_CPU_PIN=0``);
- ``stock-mcs-pa``: the same with ``-mcpa`` (the worker's arena in shared page-locked memory);
- ``exact``, ``fast``: the project's engine (``glm53.engine.exl3.backend.Exl3Backend``) in that mode under
  ``--vram-limit-gb``. If the engine refuses the mode (``NotImplementedError`` or a configuration error) the arm
  reports ``not available`` with the reason;
- ``exact-prefetch``: exact mode with ``--prefetch 1`` (the router's prediction); ``exact-oracle``: the same, but each
  decode job runs twice on its prompt, first recording its true picks, then timed with them replayed as the
  prediction (the second run's prompt comes from the prefix cache up to its last page boundary; its tokens must be
  the first run's, which is checked: exact mode is bit-identical whatever is prefetched).

Every arm is measured the same way through its exllamav3 generator (greedy, one sequence): a warm-up job; decode
jobs (a fresh random prompt of ``decode_context`` tokens, then ``decode_tokens`` tokens; rate = (n - 1) / (time of
the last token - time of the first)); prefill jobs (a fresh random prompt of each length, one new token; rate =
length / time to the first token); with ``streams`` (e.g. [2, 4]), for each N, N decode jobs enqueued together
(batched decode, the generator holding N sequences: ``-ambs``), rate = all streams' tokens per second while all of
them decode. Prompts are random ids from seeded generators, the same for every arm and
never a prefix of one another, so no arm gets a prefix-cache hit. The engine's statistics are read before and
after the decode jobs: the decode hit rate is the change in hits over the change in picks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import traceback
from collections.abc import Collection
from pathlib import Path

from bench import procmem
from bench.scoreboard import ALL_ARMS, PREFETCH_ARMS, PROJECT_ARMS, find_stats
from glm53.config import GB

STOCK_ARMS = tuple(a for a in ALL_ARMS if a not in PROJECT_ARMS)  # stock-vram, stock-mcs, stock-mcs-pa
ID_LOW, ID_HIGH = 1000, 150000  # random prompt ids avoid the byte range and GLM's special ids


class NotAvailable(Exception):
    """The arm cannot run in this build (the reason is reported, the comparison goes on)."""


def random_prompt(seed: int, phase: int, rep: int, length: int, vocab: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng([seed, phase, rep, length])
    return rng.integers(ID_LOW, min(vocab, ID_HIGH), size=length).tolist()


def run_job(generator, ids: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """(enqueue time, arrival time of every new token) of one greedy job."""
    t0, [times] = run_jobs(generator, [ids], new_tokens)
    return t0, times


def run_jobs(generator, prompts: list[list[int]], new_tokens: int,
             tokens: list[list[int]] | None = None) -> tuple[float, list[list[float]]]:
    """(enqueue time, per job the arrival time of every new token) of greedy jobs enqueued together: the
    generator batches their decode steps (up to its max_batch_size). ``tokens``, when given (a list per job), gets
    each job's token ids."""
    from glm53.engine.exl3.stock import greedy_job

    jobs = [greedy_job(ids, new_tokens, decode_special_tokens=True, identifier=i) for i, ids in enumerate(prompts)]
    times: list[list[float]] = [[] for _ in jobs]
    t0 = time.perf_counter()
    for job in jobs:
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r.get("stage") == "error":
                raise RuntimeError(f"the generator failed a job: {r.get('error')!r}")
            if r.get("stage") == "streaming" and r.get("token_ids") is not None:
                now = time.perf_counter()
                times[r["identifier"]] += [now] * r["token_ids"].numel()
                if tokens is not None:
                    tokens[r["identifier"]] += r["token_ids"].reshape(-1).tolist()
    return t0, times


def aggregate_decode_rate(times: list[list[float]]) -> float:
    """Tokens per second of all streams together while all of them were decoding: from the last stream's first
    token to the first stream's last token (the prefills and the tails of a batch are left out)."""
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    if end <= start:
        raise ValueError("the streams never decoded together (one ended before another began)")
    return sum(start < x <= end for t in times for x in t) / (end - start)


def decode_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def phase_hit_rate(before, after) -> float | None:
    """Hits over picks between two snapshots of the engine's statistics; None without a hit counter."""
    a, b = find_stats(after, ("hits", "picks")), find_stats(before, ("hits", "picks"))
    if a is None or b is None:
        return None
    picks = a["picks"] - b["picks"]
    return (a["hits"] - b["hits"]) / picks if picks > 0 else None


def phase_record(before, after) -> dict:
    """What ``bench.predict`` needs of one decode phase: its hit rate and, in fast mode, the CPU tier's figures at its
    end with the misses it took during it (the end of the arm's figures are the last phase's)."""
    out = {"hit_rate": phase_hit_rate(before, after)}
    a, b = find_stats(after, ("cpu_tier",)), find_stats(before, ("cpu_tier",))
    tier_a, tier_b = (a or {}).get("cpu_tier") or {}, (b or {}).get("cpu_tier") or {}
    if "split" in tier_a:
        split = {k: v - (tier_b.get("split") or {}).get(k, 0) for k, v in tier_a["split"].items() if isinstance(v, int) and not isinstance(v, bool)}
        out["cpu_tier"] = {"costs": tier_a["costs"], "split": split, "worth": tier_a.get("worth")}
    return out


def pinned_bytes(stats) -> int | None:
    found = find_stats(stats, ("pinned_bytes",))
    if found is not None:
        return found["pinned_bytes"]
    store = find_stats(stats, ("arena_bytes", "pinned"))
    return store["arena_bytes"] if store is not None and store["pinned"] else None


class Loaded:
    """What every arm hands to the measurement: a generator, the vocabulary, and a stats function."""

    def __init__(self, generator, vocab: int, stats=None, close=None, facts=None, idle=None, oracle=None):
        self.generator, self.vocab = generator, vocab
        self.oracle = oracle  # the engine's prefetcher, whose prediction a decode job replays (exact-oracle)
        self.stats = stats or (lambda: None)
        self.close = close or (lambda: None)
        self.facts = facts or {}
        self.idle = idle  # (thread ids to leave out) -> the idle engine's CPU use (project arms)


def max_streams(spec: dict) -> int:
    """Sequences the arm's generator must hold at once: 1, or the most concurrent decode streams measured."""
    return max([1, *(spec.get("streams") or ())])


def load_stock(arm: str, spec: dict) -> Loaded:
    from glm53.engine.exl3.stock import cpu_worker_threads
    from glm53.engine.exl3.stock import load_stock as load

    split = spec["mcs"] if arm != "stock-vram" else 0
    slots = max_streams(spec)
    stock = load(Path(spec["ckpt"]), cache_tokens=spec["cache_tokens"], chunk_size=spec["chunk_size"],
                 max_batch_size=slots, moe_cpu_split=split, moe_cpu_threads=spec.get("mct"), pinned_arena=arm == "stock-mcs-pa")
    generator = stock.generator(max_batch_size=slots)
    facts = {"mcs": split or None, "pinned_arena": arm == "stock-mcs-pa"}
    if split:
        facts["cpu_threads"] = cpu_worker_threads(stock)

    def close():
        generator.close()
        stock.close()

    return Loaded(generator, stock.vocab_size, close=close, facts=facts)


def load_project(arm: str, spec: dict) -> Loaded:
    from glm53 import config
    from glm53.engine.exl3.backend import Exl3Backend

    slots = str(max_streams(spec))
    argv = ["--mode", "exact" if arm in PREFETCH_ARMS else arm, "--engine", "exl3", "-m", spec["ckpt"], "-cs", str(spec["cache_tokens"]),
            "--max-batch-size", slots, "-ambs", slots, "-chunk_size", str(spec["chunk_size"])]
    if arm in PREFETCH_ARMS:
        argv += ["--prefetch", "1"]
    if spec.get("vram_limit_gb"):
        argv += ["--vram-limit-gb", f"{spec['vram_limit_gb']:.2f}"]
    if spec.get("cache_experts") is not None:
        argv += ["--ec-cache-experts", str(spec["cache_experts"])]
    if spec.get("link_emulate_gbs"):
        argv += ["--link-emulate-gbs", str(spec["link_emulate_gbs"])]
    argv += spec.get("project_args", [])  # last: they win
    try:
        settings = config.load(argv, {})
        backend = Exl3Backend(settings)
    except (NotImplementedError, config.ConfigError) as exc:
        raise NotAvailable(f"{type(exc).__name__}: {exc}") from exc
    if arm in PREFETCH_ARMS and backend.offload.prefetch is None:
        backend.close()
        raise NotAvailable("the engine started without prefetch (see its log)")
    return Loaded(EngineSteps(backend), backend.info.vocab_size, stats=backend.stats, close=backend.close,
                  facts={"engine_argv": argv, "settings": settings.public(), **ram_estimate(settings)},
                  idle=lambda exclude: idle_cpu_percent(backend, exclude),
                  oracle=backend.offload.prefetch if arm == "exact-oracle" else None)


def ram_estimate(settings) -> dict:
    """What ``glm53 serve``'s preflight would say this arm needs in host RAM (GB): the measured RSS is set against it
    and against the checkpoint's routed-expert bytes (issue 22: host RSS within 1.02x the routed experts plus the
    stated overhead)."""
    from glm53 import preflight
    from glm53.models import checkpoint

    return {"preflight_ram_gb": preflight.ram_needed(checkpoint.expert_bytes(Path(settings.model_dir)), settings) / GB}


class EngineSteps:
    """The project's generator as the server steps it: every step through ``Exl3Backend.iterate`` (the CPU tier woken
    before it and its live costs refreshed after), jobs enqueued on exllamav3's generator as for the stock arms."""

    def __init__(self, backend):
        self.backend = backend

    def enqueue(self, job) -> None:
        self.backend.generator.enqueue(job)

    def num_remaining_jobs(self) -> int:
        return self.backend.generator.num_remaining_jobs()

    def iterate(self) -> list[dict]:
        return self.backend.iterate()


IDLE_S = 5.0  # how long an idle engine's CPU use is measured (the kernel counts CPU time in 10 ms ticks)


def thread_cpu_seconds(exclude: Collection[int] = (), proc: Path = Path("/proc/self/task")) -> float:
    """CPU seconds of this process's threads, the thread ids in ``exclude`` left out (the measurement's own)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for task in proc.iterdir():
        if int(task.name) in exclude:
            continue
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / tick


def idle_cpu_percent(backend, exclude: Collection[int] = ()) -> dict:
    """The loaded engine's CPU use with nothing to do, in % of one core (its threads' CPU time over ``IDLE_S``, after
    the CPU tier's worker had time to park; the threads in ``exclude``, this measurement's, left out)."""
    fast = backend.offload.tier
    time.sleep(0.2)
    cpu0, wall0 = thread_cpu_seconds(exclude), time.monotonic()
    time.sleep(IDLE_S)
    out = {"idle_cpu_percent_of_one_core": round(100 * (thread_cpu_seconds(exclude) - cpu0) / (time.monotonic() - wall0), 3)}
    if fast is not None:
        out["cpu_tier_parked"] = fast.worker.parked()
    return out


def phase(name: str) -> None:
    """A timestamped line in the arm's log: how far an arm got when it is killed."""
    print(f"{time.strftime('%H:%M:%S')} phase: {name}", flush=True)


def measure(loaded: Loaded, spec: dict) -> dict:
    seed, vocab, gen = spec["seed"], loaded.vocab, loaded.generator
    phase("warm-up")
    run_job(gen, random_prompt(seed, 0, 0, 64, vocab), spec["warmup_tokens"])
    before = loaded.stats()
    decode_runs = []
    phase("decode")
    oracle_checks = []
    for rep in range(spec["decode_reps"]):
        prompt = random_prompt(seed, 1, rep, spec["decode_context"], vocab)
        if loaded.oracle is not None:
            first = oracle_pass(loaded, prompt, spec["decode_tokens"])
            replayed: list[list[int]] = [[]]
            _, [times] = run_jobs(gen, [prompt], spec["decode_tokens"], replayed)
            oracle_checks.append(replayed[0] == first)
        else:
            _, times = run_job(gen, prompt, spec["decode_tokens"])
        decode_runs.append(decode_rate(times))
    if loaded.oracle is not None:
        loaded.oracle.replay(None)
    after = loaded.stats()
    prefill_runs = {}
    phase("prefill")
    for length in spec["prefill_lengths"]:
        rates = []
        for rep in range(spec["prefill_reps"]):
            t0, times = run_job(gen, random_prompt(seed, 2, rep, length, vocab), 1)
            rates.append(length / (times[0] - t0))
        prefill_runs[str(length)] = rates
    streams, phases = {}, {"1": phase_record(before, after)}
    for n in spec.get("streams") or ():
        phase(f"{n} streams")
        prompts = [random_prompt(seed, 4, n * 100 + i, spec["decode_context"], vocab) for i in range(n)]
        start = loaded.stats()
        _, times = run_jobs(gen, prompts, spec["decode_tokens"])
        streams[str(n)] = aggregate_decode_rate(times)
        phases[str(n)] = phase_record(start, loaded.stats())
    final = loaded.stats()
    oracle = find_stats(after, ("oracle_hit_rate",))
    return {
        "decode_tok_s": statistics.median(decode_runs),
        "decode_runs": decode_runs,
        "prefill_tok_s": {k: statistics.median(v) for k, v in prefill_runs.items()},
        "prefill_runs": prefill_runs,
        "decode_streams_tok_s": streams,
        "decode_phases": phases,  # per stream count: hit rate, the tier's figures (bench.predict's inputs)
        "hit_rate": phase_hit_rate(before, after),
        "oracle_hit_rate": oracle["oracle_hit_rate"] if oracle else None,
        "pinned_bytes": pinned_bytes(final),
        "engine_stats": final,
        **({"oracle_same_tokens": all(oracle_checks)} if loaded.oracle is not None else {}),
    }


def oracle_pass(loaded: Loaded, prompt: list[int], new_tokens: int) -> list[int]:
    """exact-oracle's first run of a decode job: its true picks recorded and set to be replayed (the prediction of
    the timed run of the same prompt that follows). Returns its tokens."""
    pf = loaded.oracle
    pf.record()
    tokens: list[list[int]] = [[]]
    run_jobs(loaded.generator, [prompt], new_tokens, tokens)
    pf.replay(pf.recorded())
    return tokens[0]


def long_context_phase(loaded: Loaded, spec: dict) -> dict:
    """Decode right after a long prompt (the elastic loan's return): one job of a fresh ``long_context``-token
    prompt and ``decode_tokens`` new tokens; the rate over its first second of decode against the rate over its
    second half (the same context length, so attention cost is alike), with the engine's elastic counters."""
    gen, n = loaded.generator, spec["long_context"]
    before = loaded.stats()
    t0, times = run_job(gen, random_prompt(spec["seed"], 3, 0, n, loaded.vocab), spec["decode_tokens"])
    after = loaded.stats()
    first = [t for t in times if t - times[0] <= 1.0]
    half = times[len(times) // 2:]
    out = {"context": n, "prefill_tok_s": n / (times[0] - t0), "tokens": len(times),
           "first_second_tok_s": decode_rate(first) if len(first) > 1 else None,
           "second_half_tok_s": decode_rate(half) if len(half) > 1 else None,
           "first_8_token_gaps_ms": [round((b - a) * 1000, 2) for a, b in zip(times[:8], times[1:9])]}
    e0, e1 = find_stats(before, ("restored_experts",)), find_stats(after, ("restored_experts",))
    if e0 is not None and e1 is not None:
        out["elastic"] = {k: e1[k] - e0[k] for k in ("enter", "exit", "restored_experts", "realloc_failures")}
        out["elastic"]["lent_bytes"] = e1["lent_bytes"]
    return out


def run_arm(arm: str, spec: dict) -> dict:
    import torch

    from glm53.host import meminfo

    available_before = meminfo(Path("/proc/meminfo")).get("MemAvailable")
    with procmem.PeakSampler(os.getpid()) as sampler:
        t0 = time.monotonic()
        loaded = (load_stock if arm in STOCK_ARMS else load_project)(arm, spec)
        load_seconds = time.monotonic() - t0
        result = measure(loaded, spec)
        if spec.get("long_context") and arm in PROJECT_ARMS:
            result["long_context"] = long_context_phase(loaded, spec)
        if loaded.idle is not None:
            result["idle"] = loaded.idle({sampler.native_id})
        steady = procmem.tree_memory(os.getpid())
        available_after = meminfo(Path("/proc/meminfo")).get("MemAvailable")
        free, total = torch.cuda.mem_get_info()
        result.update(
            load_seconds=load_seconds,
            vram_max_allocated_gb=torch.cuda.max_memory_allocated() / GB,
            vram_device_used_gb=(total - free) / GB,
        )
        loaded.close()
    from glm53.engine.exl3.patches import installed_version

    result.update(
        status="ok",
        exllamav3=installed_version(),
        host_rss_peak_gb=sampler.peak / GB,
        host_rss_steady_gb=steady["rss"] / GB,
        host_pss_steady_gb=steady["pss"] / GB if steady["pss"] is not None else None,
        host_hwm_sum_gb=steady["hwm"] / GB,
        host_processes=steady["processes"],
        mem_available_drop_gb=(available_before - available_after) / GB if available_before and available_after else None,
        **loaded.facts,
    )
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.compare_arm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", required=True, choices=STOCK_ARMS + PROJECT_ARMS)
    ap.add_argument("--spec", required=True, type=Path, help="the measurement settings (JSON written by compare.py)")
    ap.add_argument("--result", required=True, type=Path, help="where to write the arm's JSON")
    args = ap.parse_args(argv)
    # the engine's start-up figures (the CPU tier's measured costs) and warnings go to the arm's log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stdout)
    spec = json.loads(args.spec.read_text())
    try:
        result = run_arm(args.arm, spec)
    except NotAvailable as exc:
        result = {"status": "not available", "reason": str(exc)}
    except Exception:  # the traceback goes to the log the orchestrator keeps; the result says it failed
        traceback.print_exc()
        result = {"status": "error", "error_tail": traceback.format_exc()[-2000:]}
    args.result.write_text(json.dumps(result, indent=1, default=str) + "\n")  # default: engine statistics of any type
    print(f"arm {args.arm}: {result['status']}", flush=True)
    return 0 if result["status"] in ("ok", "not available") else 1


if __name__ == "__main__":
    sys.exit(main())
