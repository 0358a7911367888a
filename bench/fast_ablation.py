"""Where fast mode's decode loses to exact mode's (issue 16): one exact-mode engine, then one fast-mode engine whose
CPU tier is switched part by part, each decoding the same greedy tokens after the same prompt, with the host time
of the tier's per-step hooks timed around every step:

- ``exact``: exact mode (its own engine, loaded first and closed): the reference;
- ``exact-one-thread``: the same engine with torch's CPU threads at one, and ``exact-one-cpu`` with that and the
  feeding thread kept to one CPU, as the fast engine's is while its tier takes part (``FeedingThread.confine``: on
  the H200 host the paused fast engine decoded 5-7 % faster than the exact engine and launched a step in 4.3 ms
  against 6.5; is it the thread count, or the CPU the thread stays on?);
- ``tier``: fast mode as it runs (its own decisions: split, rest, probes, refreshes);
- ``no-rest``: the same, but the hooks' host time is not counted as a cost (``Tuning.hook_weight`` 0): the tier takes part
  whenever its table sends the CPU anything, which tells whether resting for the hooks' sake pays;
- ``gpu-worth``: the same, with the hooks charged their time on the GPU's clock instead of the host's
  (``Tuning.hook_cost`` "gpu"), the rule that would replace today's if ``no-rest`` beats ``tier``;
- ``no-probes``: no probe steps (``Tuning.probe_steps`` out of reach) while it rests;
- ``no-refresh``: no probes, no timed layers and no cost refreshes either;
- ``inert``: the tier paused (every expert on the GPU) and its step hooks not called: what is left is the hooks'
  Python shells on the fast engine, an upper bound for any rule that only decides when the tier works.

One stream, decode as ``bench.decode_kl``'s paths run it (the model's forward, one token a step), the tier's
``before_step``/``after_step`` around each forward as the server's generator step has them; each forward's launch
is timed apart from its whole (a launch as long as the forward: the thread feeding the GPU is the bound). ``--cpu-hog all``
keeps every CPU busy for the whole run (``bench.cpu_hog``), the engines' start-up measurements included.

    python3 -m bench.fast_ablation -m CKPT --tokens 128 --engine-args "--ec-cache-experts 384 --vram-limit-gb 15.4"
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from bench.decode_kl import ModelPath, check_one_engine_args, one_engine_args, pages_for, synthetic_prompt
from bench.output import emit_json

EXACT_RUNS = ("exact", "exact-one-thread", "exact-one-cpu")
FAST_RUNS = ("tier", "no-rest", "gpu-worth", "no-probes", "no-refresh", "inert")
WARMUP_TOKENS = 64  # enough steps for the tier's first refreshes (and its rest, if it rests)


def engine_argv(mode: str, model: Path, cache_tokens: int, engine_args: str) -> list[str]:
    return ["--engine", "exl3", "--mode", mode, "-m", str(model), "-cs", str(cache_tokens),
            "-chunk_size", str(min(2048, cache_tokens)), "--max-batch-size", "1", "-ambs", "1", *shlex.split(engine_args)]


class StepTimer:
    """The host seconds of each step's ``before``, its forward (launched, then to its token on the host) and
    ``after``. A forward whose launch takes about as long as the whole forward is bound by the thread feeding the
    GPU (its host work), not by the GPU."""

    PARTS = ("before_step", "forward_launch", "forward", "after_step")

    def __init__(self, before=None, after=None):
        self.before, self.after = before, after
        self.samples: list[tuple[float, float, float, float]] = []

    def logits(self, path: ModelPath, ids: Sequence[int]) -> int:
        """The greedy token after ``ids`` (the step timed)."""
        t0 = time.perf_counter()
        if self.before is not None:
            self.before()
        t1 = time.perf_counter()
        out = path.logits(ids)
        t_launched = time.perf_counter()
        token = int(torch.argmax(out))  # the step's sync, as the sampler's
        t2 = time.perf_counter()
        if self.after is not None:
            self.after()
        self.samples.append((t1 - t0, t_launched - t1, t2 - t1, time.perf_counter() - t2))
        return token

    def summary(self) -> dict:
        cols = list(zip(*self.samples)) if self.samples else [()] * len(self.PARTS)
        out = {}
        for name, col in zip(self.PARTS, cols):
            col = sorted(col)
            out[name + "_us"] = {"mean": round(1e6 * statistics.fmean(col), 1) if col else None,
                                 "p90": round(1e6 * col[int(0.9 * (len(col) - 1))], 1) if col else None,
                                 "max": round(1e6 * col[-1], 1) if col else None}
        return out


def decode(path: ModelPath, prompt: Sequence[int], tokens: int, timer: StepTimer) -> tuple[list[int], float]:
    """Greedy ids of ``tokens`` steps after ``prompt`` and the decode's seconds (the prompt's forward not counted)."""
    ids = [timer.logits(path, prompt)]
    timer.samples.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        ids.append(timer.logits(path, [ids[-1]]))
    torch.cuda.synchronize()
    return ids, time.perf_counter() - t0


NEVER = 1 << 40  # steps: out of reach
RUN_TUNING = {"no-rest": {"hook_weight": 0.0}, "gpu-worth": {"hook_cost": "gpu"}, "no-probes": {"probe_steps": NEVER},
              "no-refresh": {"probe_steps": NEVER, "refresh_steps": NEVER, "sample_steps": NEVER}}


def run_tuning(run: str, tuning):
    """The CPU tier's tuning (``glm53.cpu_tier.tuning.Tuning``) for one of the fast runs: ``tuning`` changed as the
    run asks (``tier`` and ``inert``: as it is)."""
    return replace(tuning, **RUN_TUNING.get(run, {}))


def run_engine(mode: str, args, runs: Sequence[str]) -> dict:
    from glm53 import config
    from glm53.engine.exl3.backend import Exl3Backend

    cache_tokens = pages_for(args.prompt_tokens + max(args.tokens, WARMUP_TOKENS) + 1)
    t0 = time.monotonic()
    engine = Exl3Backend(config.load(engine_argv(mode, args.model, cache_tokens, args.engine_args), {}), extra_caches=1)
    out = {"load_s": round(time.monotonic() - t0, 1), "runs": {}}
    try:
        fast = engine.offload.tier if engine.offload is not None else None
        if mode == "fast" and fast is None:
            raise SystemExit("the fast engine started without its CPU tier (see its log; GLM53_CT_ENABLE=1 forces it)")
        prompt = synthetic_prompt(engine.info.vocab_size, args.prompt_tokens)
        path = ModelPath(engine.model, engine.extra_caches[0], engine.info.vocab_size)
        hooked = StepTimer(fast.before_step, fast.after_step) if fast is not None else StepTimer()
        decode(path, prompt, WARMUP_TOKENS, hooked)  # kernels, the cache's admissions, the tier's first decisions
        path.reset()
        for name in runs:
            inert = name == "inert"
            threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
            if name in ("exact-one-thread", "exact-one-cpu"):
                torch.set_num_threads(1)
            if name == "exact-one-cpu":
                os.sched_setaffinity(0, {min(cpus)})
            timer = StepTimer() if inert or fast is None else StepTimer(fast.before_step, fast.after_step)
            with fast.tuned(run_tuning(name, fast.tuning)) if fast is not None else contextlib.nullcontext(), \
                    fast.paused() if inert else contextlib.nullcontext():
                if inert:
                    fast.worker.rest()
                if name in ("no-rest", "gpu-worth") and fast is not None:
                    fast.controller.worth.resting = False  # a rest begun in an earlier run would otherwise last until a probe
                misses0 = engine.offload.cache.stats()["misses"]
                ids, seconds = decode(path, prompt, args.tokens, timer)
                misses = engine.offload.cache.stats()["misses"] - misses0
            path.reset()
            torch.set_num_threads(threads)
            os.sched_setaffinity(0, cpus)
            run = {"decode_tok_s": round((args.tokens - 1) / seconds, 2), "ms_per_step": round(1e3 * seconds / (args.tokens - 1), 3),
                   "misses_per_step": round(misses / (args.tokens - 1), 2),  # bench.predict's inputs
                   "torch_threads": 1 if name.startswith("exact-one") else threads, "ids": ids, **timer.summary()}
            if fast is not None:
                stats = fast.stats()
                run["worth"] = stats["worth"]
                run["split"] = stats["split"]
                run["probes"] = stats["device"]["probes"]
                run["costs"] = stats["costs"]
            out["runs"][name] = run
        out["link"] = {k: v for k, v in engine.offload.cache.link.stats().items() if k != "held"}
        return out
    finally:
        engine.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m bench.fast_ablation", description=__doc__.split("\n\n")[0])
    one_engine_args(ap, "--ec-cache-experts 11%", "more glm53 settings for both engines")
    ap.add_argument("--cpu-hog", default=None, help="CPUs kept busy for the whole run ('all' or a list like 2-5)")
    return check_one_engine_args(ap, ap.parse_args(argv))


def run(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.cpu_hog:
            from bench.cpu_hog import CpuHog, parse_cpus

            cpus = sorted(os.sched_getaffinity(0)) if args.cpu_hog == "all" else parse_cpus(args.cpu_hog)
            stack.enter_context(CpuHog(cpus))
        exact = run_engine("exact", args, EXACT_RUNS)
        fast = run_engine("fast", args, FAST_RUNS)
    runs = {**exact["runs"], **fast["runs"]}
    base = runs["exact"]["decode_tok_s"]
    out = {"checkpoint": str(args.model), "tokens": args.tokens, "engine_args": args.engine_args, "cpu_hog": args.cpu_hog,
           "load_s": {"exact": exact["load_s"], "fast": fast["load_s"]},
           "vs_exact": {name: round(r["decode_tok_s"] / base, 3) for name, r in runs.items()},
           "same_tokens_as_exact": {name: r["ids"] == runs["exact"]["ids"] for name, r in runs.items()},
           "runs": {name: {k: v for k, v in r.items() if k != "ids"} for name, r in runs.items()},
           "seconds": round(time.monotonic() - started, 1),
           "command": shlex.join(["python3", "-m", "bench.fast_ablation", *sys.argv[1:]])}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    emit_json(result, args.out)
    for name, r in result["runs"].items():
        print(f"{name}: {r['decode_tok_s']} tok/s ({result['vs_exact'][name]}x exact), forward launched in "
              f"{r['forward_launch_us']['mean']} of {r['forward_us']['mean']} us; after_step {r['after_step_us']['mean']} us mean, "
              f"{r['after_step_us']['max']} max; before_step {r['before_step_us']['mean']} us", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
