"""Where a decode step's MoE time goes, layer by layer, on the GPU's own clock: exact mode against fast mode (the
CPU tier) over one loaded model, so that the CPU tier's gain or loss can be traced to a phase.

Per routed MoE layer and decode step, CUDA events mark four points of the compute stream:

    routed    the router's picks are made (the offload's routing hook is entered)
    split     the expert cache's step and, in fast mode, the CPU tier's split and publish are queued
    summed    the GPU's experts are done (the fp32 routed sum reaches the CPU tier's combine)
    combined  the CPU's partial is in (fast mode) or nothing was waited for (exact)

and two device counters: the layer's missed picks after the cache's step (experts read over the link, or sent to
the CPU) and the experts the split sent to the CPU. From them:

- ``gpu_experts_us`` by the number of misses the GPU computes (``by_gpu_misses``), and its least-squares line
  ``fit.fixed_us + fit.per_miss_us * misses``: the in-place cost of one more zero-copy miss, to set against the
  cost model's link figure (``glm53.cpu_tier.split``: one expert's bytes over the measured link rate);
- ``wait_us`` (summed to combined) by the number of experts sent to the CPU (``by_cpu_experts``): what a job costs
  the GPU beyond its own part;
- ``step_us``: the whole decode step per token, and ``moe_us``: the layers' routed-to-combined time summed;
- the WINDOWS outside the MoE layers, where the link is idle (what a prefetch can overlap, issue 20): ``gap_us``
  from one layer's combined point to the next layer's routed point (its tail, the next layer's attention and
  router), per layer and in all; ``lead_us`` from the step's start to its first layer's routed point (the
  embedding, the dense layers, the first attention); ``tail_us`` from the last layer's combined point to the next
  step's start (the head, the sampler's sync, the host's launch of the next step).

    python3 -m bench.moe_profile -m CKPT --tokens 128 --out profile.json [--engine-args "--ec-cache-experts 11%"]

The events cost a few microseconds of host time each (4 a layer); both modes pay it alike.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench.decode_kl import ModelPath, engine_argv, pages_for, synthetic_prompt
from bench.output import emit_json

POINTS = ("routed", "split", "summed", "combined")


class LayerClock:
    """Marks the four points of every routed MoE layer call of the engine's offload (``Exl3Backend.offload``) and
    its miss and CPU-expert counts, on the device, for ``capacity`` calls. ``read()`` synchronises once."""

    def __init__(self, offload, capacity: int):
        if offload.tier is None:
            raise ValueError("the clock needs the CPU tier's hooks (an engine in fast mode with --ct-enable 1), also for exact")
        self.offload, self.fast, self.capacity = offload, offload.tier, capacity
        dev = offload.device
        self.events = [[torch.cuda.Event(enable_timing=True) for _ in POINTS] for _ in range(capacity)]
        self.misses = torch.zeros(capacity, dtype=torch.int32, device=dev)
        self.cpu_experts = torch.zeros(capacity, dtype=torch.int32, device=dev)
        self.rows: list[int] = []
        self.step_marks: list[tuple[torch.cuda.Event, int]] = []  # (event, calls so far) at each step's start
        self._open: int | None = None
        self._original_routed = offload.routed
        self._original_sum = self.fast.routed_sum
        self._original_split = self.fast.producer.split_publish
        offload.routed = self._routed
        self.fast.routed_sum = self._routed_sum
        self.fast.producer.split_publish = self._split_publish

    def close(self) -> None:
        del self.offload.routed
        del self.fast.routed_sum
        del self.fast.producer.split_publish

    def mark_step(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.step_marks.append((event, len(self.rows)))

    def _routed(self, row, selected, weights=None, z=None):
        decode = selected.shape[0] <= self.offload.policy.decode_rows and not self.offload.prefilling
        i = len(self.rows)
        if not decode or i >= self.capacity:
            self._open = None
            return self._original_routed(row, selected, weights, z)
        self._open = i
        self.rows.append(row)
        self.events[i][0].record()
        out = self._original_routed(row, selected, weights, z)
        missed = (self.offload.cache.slot_of[row][selected] < 0).sum().to(torch.int32)
        self.misses[i : i + 1].copy_(missed.view(1))
        self.events[i][1].record()
        return out

    def _split_publish(self, *args, **kwargs):
        status, info, record = self._original_split(*args, **kwargs)
        if self._open is not None:
            self.cpu_experts[self._open : self._open + 1].copy_(info[2:3])
        return status, info, record

    def _routed_sum(self, row, final_hidden_states):
        i = self._open
        if i is not None:
            self.events[i][2].record()
        out = self._original_sum(row, final_hidden_states)
        if i is not None:
            self.events[i][3].record()
            self._open = None
        return out

    def read(self) -> dict:
        """Per call: row, misses, CPU experts and the three intervals in microseconds; per step: its span."""
        torch.cuda.synchronize()
        n = len(self.rows)
        spans = np.array([[self.events[i][a].elapsed_time(self.events[i][a + 1]) * 1000.0 for a in range(3)]
                          for i in range(n)]).reshape(n, 3)
        steps = [(a.elapsed_time(b) * 1000.0, cb - ca) for (a, ca), (b, cb) in zip(self.step_marks, self.step_marks[1:])]
        gaps = [(self.rows[i + 1], self.events[i][3].elapsed_time(self.events[i + 1][0]) * 1000.0) for i in range(n - 1)
                if self.rows[i + 1] == self.rows[i] + 1]  # within a step: the next layer's call follows
        leads = [a.elapsed_time(self.events[ca][0]) * 1000.0 for (a, ca), (_, cb) in zip(self.step_marks, self.step_marks[1:])
                 if cb > ca and self.rows[ca] == 0]
        tails = [self.events[cb - 1][3].elapsed_time(b) * 1000.0 for (_, ca), (b, cb) in zip(self.step_marks, self.step_marks[1:])
                 if cb > ca]
        return {"row": np.array(self.rows), "misses": self.misses[:n].cpu().numpy(),
                "cpu_experts": self.cpu_experts[:n].cpu().numpy(), "split_us": spans[:, 0], "gpu_experts_us": spans[:, 1],
                "wait_us": spans[:, 2], "steps": steps, "gaps": gaps, "lead_us": np.array(leads), "tail_us": np.array(tails)}


def summarise(calls: dict, layers: int) -> dict:
    """The tables the module docstring describes, from ``LayerClock.read()``."""
    misses, cpu = calls["misses"].astype(int), calls["cpu_experts"].astype(int)
    gpu_misses = misses - cpu
    gpu_us, wait_us, split_us = calls["gpu_experts_us"], calls["wait_us"], calls["split_us"]

    def table(keys: np.ndarray, values: np.ndarray) -> dict[int, dict]:
        out = {}
        for k in np.unique(keys):
            v = values[keys == k]
            out[int(k)] = {"calls": int(v.size), "mean_us": round(float(v.mean()), 1), "p90_us": round(float(np.percentile(v, 90)), 1)}
        return out

    fit = None
    if np.unique(gpu_misses).size >= 2:
        slope, intercept = np.polyfit(gpu_misses.astype(float), gpu_us, 1)
        fit = {"fixed_us": round(float(intercept), 1), "per_miss_us": round(float(slope), 1)}
    full_steps = [us for us, calls_in in calls["steps"] if calls_in == layers]
    moe_per_call = split_us + gpu_us + wait_us
    gaps = calls.get("gaps") or []
    gap_rows = np.array([r for r, _ in gaps], dtype=int)
    gap_us = np.array([us for _, us in gaps], dtype=float)

    def median(values) -> float | None:
        values = np.asarray(values, dtype=float)
        return round(float(np.median(values)), 1) if values.size else None

    windows = {
        "gap_us": median(gap_us),  # one layer's end to the next one's routing: what a next-layer prefetch can hide
        "gap_us_by_layer": {int(r): median(gap_us[gap_rows == r]) for r in np.unique(gap_rows)},
        "lead_us": median(calls.get("lead_us", ())),
        "tail_us": median(calls.get("tail_us", ())),
    }
    return {
        "calls": int(misses.size),
        "misses_mean": round(float(misses.mean()), 3) if misses.size else None,
        "cpu_experts_mean": round(float(cpu.mean()), 3) if cpu.size else None,
        "split_us_mean": round(float(split_us.mean()), 1) if split_us.size else None,
        "by_gpu_misses": table(gpu_misses, gpu_us),
        "by_cpu_experts": table(cpu, wait_us),
        "fit": fit,
        "step_us": round(float(np.median(full_steps)), 1) if full_steps else None,
        "moe_us": round(float(moe_per_call.mean() * layers), 1) if moe_per_call.size else None,
        "steps": len(full_steps),
        "windows": windows,
    }


def decode(path: ModelPath, clock: LayerClock, prompt: Sequence[int], tokens: int) -> None:
    logits = path.logits(prompt)
    for _ in range(tokens):
        clock.mark_step()
        logits = path.logits([int(torch.argmax(logits))])
    clock.mark_step()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m bench.moe_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, type=Path, help="the EXL3 checkpoint")
    ap.add_argument("--tokens", type=int, default=128, help="decode steps per mode (default 128)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length before decode (default 64)")
    ap.add_argument("--modes", default="exact,fast", help="comma-separated, in order: exact, fast (default both)")
    ap.add_argument("--engine-args", default="--ec-cache-experts 11%",
                    help="glm53 settings (default: --ec-cache-experts 11%%, a 24 GB card's share on the scaled checkpoint)")
    ap.add_argument("--out", type=Path, help="write the result JSON here (default: print it)")
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    if args.tokens < 1 or args.prompt_tokens < 1 or not set(args.modes) <= {"exact", "fast"}:
        ap.error("--tokens and --prompt-tokens take positive numbers; --modes: exact, fast")
    return args


def run(args: argparse.Namespace) -> dict:
    import contextlib

    from glm53 import config
    from glm53.engine.exl3.backend import Exl3Backend

    started = time.monotonic()
    cache_tokens = pages_for(args.prompt_tokens + args.tokens + 1)
    engine = Exl3Backend(config.load(engine_argv(args.model, cache_tokens, args.engine_args), {}), extra_caches=1)
    try:
        offload, fast = engine.offload, engine.offload.tier
        layers = offload.store.num_layers
        vocab = engine.info.vocab_size
        prompt = synthetic_prompt(vocab, args.prompt_tokens)
        out = {"checkpoint": str(args.model), "tokens": args.tokens, "engine_args": args.engine_args, "modes": {}}
        for mode in args.modes:
            if fast is None:
                raise SystemExit("the engine started without its CPU tier (see its log); both modes need its hooks")
            context = fast.paused if mode == "exact" else contextlib.nullcontext
            path = ModelPath(engine.model, engine.extra_caches[0], vocab, mode=context)
            decode(path, LayerClockOff(), prompt, 8)  # warm-up: kernels, the cache's first admissions
            path.reset()
            clock = LayerClock(offload, capacity=layers * (args.tokens + 2))
            try:
                decode(path, clock, prompt, args.tokens)
                calls = clock.read()
            finally:
                clock.close()
                path.reset()
            out["modes"][mode] = summarise(calls, layers)
        if fast is not None:
            out["cpu_tier_costs"] = fast.stats()["costs"]
        out["seconds"] = round(time.monotonic() - started, 1)
        out["command"] = shlex.join(["python3", "-m", "bench.moe_profile", *sys.argv[1:]])
        return out
    finally:
        engine.close()


class LayerClockOff:
    """A clock that marks nothing (the warm-up)."""

    def mark_step(self) -> None:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    emit_json(result, args.out)
    for mode, s in result["modes"].items():
        w = s["windows"]
        print(f"{mode}: step {s['step_us']} us, MoE {s['moe_us']} us, misses {s['misses_mean']}/layer, CPU experts "
              f"{s['cpu_experts_mean']}/layer, fit {s['fit']}; windows: between layers {w['gap_us']} us, before the first "
              f"{w['lead_us']} us, after the last {w['tail_us']} us", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
