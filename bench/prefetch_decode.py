"""Predictive prefetch on the GPU (issue 20): one engine in exact mode with ``--prefetch 1`` decodes the same greedy
token sequence five times over one load, and reports each run's rate and what prefetch did, layer by layer:

- ``off``: the prefetcher detached (the offload's hooks see none): today's exact mode;
- ``router``: the device predictor (the next layer's router scored on this layer's router input); its true picks
  are recorded on the way;
- ``oracle``: the recorded true picks of the same token sequence replayed as the prediction: what the machinery
  gives when every prediction is right (the ceiling, separate from the predictor's quality).
- ``router`` and ``oracle`` run with the lead (``GLM53_PREFETCH_LEAD``: the first MoE layer's prefetch at the step's
  start) whatever the setting; ``router-no-lead`` and ``oracle-no-lead`` without it, so that the two windows' gains
  are told apart.

Exact mode is bit-identical whatever is prefetched, so the three runs must decode the same tokens (checked). Per
layer: missed picks after the cache's step (one stream: a pick is a distinct expert), prefetched experts used and
wasted, the predictor's recall (used / missed) and precision (used / copied), and the link's bytes per step
(zero-copy misses the pool did not serve, plus every copy: prefetch and admissions). On synthetic checkpoints the
routing of consecutive layers is not correlated as a trained model's is: report the router's recall as measured
and read the oracle for what the machinery can give.

    python3 -m bench.prefetch_decode -m CKPT --tokens 128 --out prefetch.json [--engine-args "--ec-cache-experts 11%"]
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.decode_kl import ModelPath, check_one_engine_args, one_engine_args, pages_for, synthetic_prompt
from bench.output import emit_json

RUNS = ("off", "router", "oracle", "router-no-lead", "oracle-no-lead")
WARMUP_TOKENS = 8


def engine_argv(model: Path, cache_tokens: int, engine_args: str) -> list[str]:
    """Exact mode with prefetch, one sequence, then ``engine_args``."""
    return ["--engine", "exl3", "--mode", "exact", "--prefetch", "1", "-m", str(model), "-cs", str(cache_tokens),
            "-chunk_size", str(min(2048, cache_tokens)), "--max-batch-size", "1", "-ambs", "1", *shlex.split(engine_args)]


def decode(path: ModelPath, prompt: Sequence[int], tokens: int) -> tuple[list[int], float]:
    """Greedy ids of ``tokens`` decode steps after ``prompt``, and the decode's seconds (the prompt's forward not
    counted)."""
    logits = path.logits(prompt)
    ids = [int(torch.argmax(logits))]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        ids.append(int(torch.argmax(path.logits([ids[-1]]))))
    torch.cuda.synchronize()
    return ids, time.perf_counter() - t0


def layer_figures(cache_before, cache_after, pf_before, pf_after, steps: int, block_bytes: int) -> dict:
    """Per layer and in all, from the counters' differences over a run (cache: picks, hits, admissions per layer;
    prefetch: copied, used, wasted, plans)."""
    from glm53.offload.cache_policy import C_ADMITS, C_HITS, C_PICKS
    from glm53.offload.ec_native import PF_COUNTERS

    cache = cache_after - cache_before
    pf = pf_after - pf_before
    col = {name: i for i, name in enumerate(PF_COUNTERS)}
    layers = []
    for l in range(cache.shape[0]):
        missed = int(cache[l, C_PICKS] - cache[l, C_HITS])
        used, copied, wasted = (int(pf[l, col[k]]) for k in ("used", "copied", "wasted"))
        layers.append({"missed_picks": missed, "prefetch_used": used, "prefetch_copied": copied, "prefetch_wasted": wasted,
                       "recall": round(used / missed, 4) if missed else None,
                       "precision": round(used / copied, 4) if copied else None})
    missed = sum(x["missed_picks"] for x in layers)
    used = sum(x["prefetch_used"] for x in layers)
    copied = sum(x["prefetch_copied"] for x in layers)
    admitted = int(cache[:, C_ADMITS].sum())
    return {"layers": layers, "missed_picks": missed, "prefetch_used": used, "prefetch_copied": copied,
            "recall": round(used / missed, 4) if missed else None, "precision": round(used / copied, 4) if copied else None,
            "link_mb_per_step": round((missed - used + copied + admitted) * block_bytes / 1e6 / max(steps, 1), 2)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m bench.prefetch_decode", description=__doc__.split("\n\n")[0])
    one_engine_args(ap, "--ec-cache-experts 11%",
                    "more glm53 settings, e.g. --prefetch-slots 4 (default: --ec-cache-experts 11%%, a 24 GB card's share "
                    "on the scaled checkpoint)")
    return check_one_engine_args(ap, ap.parse_args(argv))


def run(args: argparse.Namespace) -> dict:
    from glm53 import config
    from glm53.engine.exl3.backend import Exl3Backend

    started = time.monotonic()
    cache_tokens = pages_for(args.prompt_tokens + args.tokens + 1)
    engine = Exl3Backend(config.load(engine_argv(args.model, cache_tokens, args.engine_args), {}), extra_caches=1)
    try:
        offload = engine.offload
        pf = offload.prefetch
        if pf is None:
            raise SystemExit("the engine started without prefetch (see its log)")
        vocab = engine.info.vocab_size
        prompt = synthetic_prompt(vocab, args.prompt_tokens)
        path = ModelPath(engine.model, engine.extra_caches[0], vocab)
        decode(path, prompt, WARMUP_TOKENS)  # kernels, the cache's first admissions
        path.reset()
        out = {"checkpoint": str(args.model), "tokens": args.tokens, "engine_args": args.engine_args,
               "prefetch": {"slots": pf.slots, "extra": pf.extra}, "runs": {}}
        recorded, ids_of, lead = None, {}, pf.schedule.leads
        for name in RUNS:
            pf.schedule.leads = name != "off" and not name.endswith("-no-lead")
            if name == "router":
                pf.replay(None)
                pf.record()
            elif name == "router-no-lead":
                pf.replay(None)
            elif name.startswith("oracle"):
                pf.replay(recorded)
            before = (offload.cache.counters.cpu().clone(), pf.counters.cpu().clone())
            with offload.detached(pf) if name == "off" else contextlib.nullcontext():
                ids, seconds = decode(path, prompt, args.tokens)
            path.reset()
            after = (offload.cache.counters.cpu().clone(), pf.counters.cpu().clone())
            if name == "router":
                recorded = pf.recorded()
            ids_of[name] = ids
            out["runs"][name] = {"decode_tok_s": round((args.tokens - 1) / seconds, 2), "lead": pf.schedule.leads and name != "off",
                                 **layer_figures(before[0], after[0], before[1], after[1], args.tokens, offload.cache.block_bytes)}
        pf.schedule.leads = lead
        pf.replay(None)
        out["same_tokens"] = all(ids == ids_of["off"] for ids in ids_of.values())
        base = out["runs"]["off"]["decode_tok_s"]
        out["speedup"] = {name: round(out["runs"][name]["decode_tok_s"] / base, 3) for name in RUNS}
        out["seconds"] = round(time.monotonic() - started, 1)
        out["command"] = shlex.join(["python3", "-m", "bench.prefetch_decode", *sys.argv[1:]])
        return out
    finally:
        engine.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    emit_json(result, args.out)
    for name, r in result["runs"].items():
        print(f"{name}: {r['decode_tok_s']} tok/s ({result['speedup'][name]}x), recall {r['recall']}, precision "
              f"{r['precision']}, link {r['link_mb_per_step']} MB a step", file=sys.stderr)
    print(f"same tokens in every run: {result['same_tokens']}", file=sys.stderr)
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
