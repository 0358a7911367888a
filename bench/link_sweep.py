"""Fast mode against exact mode across host-link rates, on one engine per mode: the in-band emulation of a slower
link (``glm53.offload.link``) is switched between runs (``Link.retarget``; the CPU tier's link figure is timed again
through it, as at start), and each run decodes the same greedy tokens after the same prompt, one stream, as
``bench.fast_ablation``'s runs do (the tier's ``before_step``/``after_step`` around each forward).

Rates: ``full`` (no emulation), ``measured`` (emulation at the rate measured at start: it must cost nothing
measurable) and numbers in GB/s. Per run: decode rate, ms a step, the link's held time a step by kind, the cache's
misses a step, and for fast mode the tier's split, costs and rest. For exact mode, the emulation is checked against
the per-layer model it implements: a step at W_target should take T_fix + misses x B / W_target, T_fix being the
full link's step less its misses' reads at the measured rate (``check.measured_over_model``); and every rate's tokens
are the full link's (``check.same_tokens``: the emulation never touches the arithmetic).

    python3 -m bench.link_sweep -m CKPT --gbs full measured 25 12.5 --tokens 128 \\
        --engine-args "--ec-cache-experts 384 --vram-limit-gb 15.4"
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence


from bench.decode_kl import ModelPath, check_one_engine_args, one_engine_args, pages_for, synthetic_prompt
from bench.fast_ablation import WARMUP_TOKENS, StepTimer, decode, engine_argv
from bench.output import emit_json

MODES = ("exact", "fast")


def parse_rate(text: str) -> str | float:
    if text in ("full", "measured"):
        return text
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: a rate in GB/s, 'full' or 'measured'")
    return value


def _misses(cache) -> int:
    return cache.stats()["misses"]  # decode steps' (picks less hits)


def _held(link) -> dict[str, float]:
    return {name: v["seconds"] for name, v in (link.stats().get("held") or {}).items()}


def run_engine(mode: str, args) -> dict:
    from glm53 import config
    from glm53.engine.exl3.backend import Exl3Backend

    cache_tokens = pages_for(args.prompt_tokens + max(args.tokens, WARMUP_TOKENS) + 1)
    t0 = time.monotonic()
    # the fast engine starts on the full link, where its tier may not pay: it is kept on, to follow the later links
    engine_args = ("--ct-enable 1 " if mode == "fast" else "") + args.engine_args
    engine = Exl3Backend(config.load(engine_argv(mode, args.model, cache_tokens, engine_args), {}), extra_caches=1)
    out = {"load_s": round(time.monotonic() - t0, 1), "runs": {}}
    try:
        offload = engine.offload
        fast, cache, link = offload.tier, offload.cache, offload.cache.link
        if mode == "fast" and fast is None:
            raise SystemExit("the fast engine started without its CPU tier (see its log; GLM53_CT_ENABLE=1 forces it)")
        prompt = synthetic_prompt(engine.info.vocab_size, args.prompt_tokens)
        path = ModelPath(engine.model, engine.extra_caches[0], engine.info.vocab_size)
        timer = StepTimer(fast.before_step, fast.after_step) if fast is not None else StepTimer()
        for rate in args.gbs:
            link.retarget(None if rate == "full" else link.measured().zero_copy_gbs if rate == "measured" else rate)
            if fast is not None:
                fast.remeasure_link()
            decode(path, prompt, WARMUP_TOKENS, timer)  # the tier's refreshes follow the new link
            path.reset()
            held0, misses0 = _held(link), _misses(cache)
            split0 = fast.stats()["split"] if fast is not None else {}
            ids, seconds = decode(path, prompt, args.tokens, timer)
            steps = args.tokens - 1
            held1, misses = _held(link), _misses(cache) - misses0
            path.reset()
            run = {"link_gbs": link.target_gbs, "decode_tok_s": round(steps / seconds, 2), "ms_per_step": round(1e3 * seconds / steps, 3),
                   # the prompt's forward is in the counters too: per decode step, roughly
                   "held_ms_per_step": {k: round(1e3 * (held1[k] - held0.get(k, 0.0)) / steps, 4) for k in held1},
                   "misses_per_step": round(misses / steps, 2), "ids": ids}
            if fast is not None:
                stats = fast.stats()
                split = {k: v - split0[k] if isinstance(v, int) and not isinstance(v, bool) else v for k, v in stats["split"].items()}
                run.update(split=split, worth=stats["worth"], costs=stats["costs"], worker=stats["worker"], device=stats["device"])
            out["runs"][str(rate)] = run
        out["link"] = {k: v for k, v in link.stats().items() if k != "held"}
        out["block_bytes"], out["moe_layers"] = offload.store.layout.block_bytes, offload.store.num_layers
        return out
    finally:
        engine.close()


def check_exact(exact: dict) -> dict:
    """The emulation against its model on exact mode's runs (see the module's docstring)."""
    runs, B = exact["runs"], exact["block_bytes"]
    measured = (exact.get("link") or {}).get("measured", {}).get("zero_copy_gbs")
    full = runs.get("full")
    out = {"same_tokens": {name: r["ids"] == full["ids"] for name, r in runs.items()} if full else None}
    if full and measured:
        # a step's fixed part: the full link's step less its misses read at the measured rate
        fixed_ms = full["ms_per_step"] - 1e3 * full["misses_per_step"] * B / (measured * 1e9)
        out["fixed_ms"] = round(fixed_ms, 3)
        out["measured_over_model"] = {
            name: round(r["ms_per_step"] / (fixed_ms + 1e3 * r["misses_per_step"] * B / (r["link_gbs"] * 1e9)), 4)
            for name, r in runs.items() if r["link_gbs"]}
        if "measured" in runs:
            out["measured_rate_over_full"] = round(runs["measured"]["ms_per_step"] / full["ms_per_step"], 4)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m bench.link_sweep", description=__doc__.split("\n\n")[0])
    one_engine_args(ap, "--ec-cache-experts 11%", "more glm53 settings for both engines")
    ap.add_argument("--gbs", nargs="+", type=parse_rate, default=["full", "measured", 25.0, 12.5],
                    help="link rates, in order: full, measured, or GB/s (default: full measured 25 12.5)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="engines to run (default: exact fast)")
    return check_one_engine_args(ap, ap.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    engines = {mode: run_engine(mode, args) for mode in args.modes}
    result = {"checkpoint": str(args.model), "tokens": args.tokens, "engine_args": args.engine_args,
              "engines": {m: {**e, "runs": {n: {k: v for k, v in r.items() if k != "ids"} for n, r in e["runs"].items()}}
                          for m, e in engines.items()},
              "seconds": round(time.monotonic() - started, 1),
              "command": shlex.join(["python3", "-m", "bench.link_sweep", *(sys.argv[1:] if argv is None else argv)])}
    if "exact" in engines:
        result["check"] = check_exact(engines["exact"])
    if {"exact", "fast"} <= set(engines):
        result["fast_over_exact"] = {name: round(r["decode_tok_s"] / engines["exact"]["runs"][name]["decode_tok_s"], 3)
                                     for name, r in engines["fast"]["runs"].items() if name in engines["exact"]["runs"]}
    emit_json(result, args.out)
    for mode, e in result["engines"].items():
        for name, r in e["runs"].items():
            extra = f", CPU took {r['split']['cpu_experts']} of {r['split']['misses']} misses, resting {r['worth']['resting']}" \
                if "split" in r else ""
            print(f"{mode} @ {name}: {r['decode_tok_s']} tok/s ({r['misses_per_step']} misses a step){extra}", file=sys.stderr)
    print(f"fast / exact: {result.get('fast_over_exact')}; check: {result.get('check')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
