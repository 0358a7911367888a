#!/usr/bin/env python3
"""Does a prompt resumed from the prefix cache see what a cache-less forward computes? On a running server, per
seed: a prompt of ``--prompt`` random token ids is prefilled (the server keeps its recurrent checkpoint), then the
prompt plus ``--more`` ids is sent (served from the cache up to a checkpoint) and its greedy token's logprob is
compared with the logprob that token gets from a cache-less forward of the same sequence (``/generate`` with
``max_new_tokens: 0`` and ``logprob_start_len``: teacher-forced scoring runs without the cache), and the resumed
token with that forward's own greedy token.

What the difference measures depends on what was cached: run the tool against servers that differ in one setting
and compare the medians, not one number against zero. On a synthetic checkpoint every rounding is amplified, so
even a run with nothing reused (``cached: 0``) differs by some tenths of a nat; on the scaled checkpoint (H200 host,
8 prompts) the medians were 0.13 with no cache, 1.6 resumed from stock exllamav3's own recurrent checkpoint
(exact mode's split forward) and 1.3 from fast mode's prompt-end checkpoint (bench/results/2026-12-01-fourth-
session-h200.md).

Two servers that resume from different checkpoints are compared head to head with ``--against`` another run's
report (the same seeds and sizes): per seed, the two resumed distributions' top ``--top`` tokens, the mean
absolute logprob difference over the tokens both list, and whether their greedy tokens agree. Run against fast mode
with ``--prompt-end-checkpoints 1`` and against fast mode with ``--prefill-last-page-split 1
--prompt-end-checkpoints 0`` (stock's split forward: its checkpoint at the same page boundary), it tells whether
the prompt-end capture gives stock's state, whatever a random-weight model does with rounding.

Python standard library only. Prints (or writes with --out) a JSON report: per seed the cached tokens, both
logprobs and their difference, the resumed top tokens, and the median difference (and the comparison).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from client import Client, add_server_args, client_from_args, utc_now, write_json


def generate(client: Client, ids: list[int], **body) -> dict:
    return client.post("/generate", {"input_ids": ids, "return_logprob": True, **body})["meta_info"]


def one(client: Client, seed: int, prompt: int, more: int, vocab: int, top: int) -> dict:
    rng = random.Random(seed)
    lo, hi = (1000, 100000) if vocab > 100000 else (vocab // 4, vocab - 1)  # plain ids: no special tokens
    first = [rng.randrange(lo, hi) for _ in range(prompt)]
    longer = first + [rng.randrange(lo, hi) for _ in range(more)]
    greedy = {"temperature": 0, "max_new_tokens": 1}
    generate(client, first, sampling_params=greedy)  # the prompt the next request resumes from
    resumed = generate(client, longer, sampling_params=greedy, top_logprobs_num=top)
    (logprob, token, _), = resumed["output_token_logprobs"]
    resumed_top = {str(t): round(v, 4) for v, t, _ in resumed["output_top_logprobs"][0]}
    scored = generate(client, longer + [token], sampling_params={"max_new_tokens": 0}, logprob_start_len=len(longer),
                      top_logprobs_num=1)
    reference = scored["input_token_logprobs"][0][0]
    (top_logprob, top_token, _), = scored["input_top_logprobs"][0]
    row = {"seed": seed, "cached": resumed.get("cached_tokens"), "resumed_logprob": round(logprob, 4),
           "reference_logprob": round(reference, 4), "difference": round(abs(logprob - reference), 4),
           "same_greedy_token": token == top_token, "reference_greedy_logprob": round(top_logprob, 4),
           "resumed_top": resumed_top}
    print(f"seed {seed}: {row}", file=sys.stderr)
    return row


def against(rows: list[dict], other: dict) -> dict:
    """Per seed both runs have: the mean absolute difference of the resumed logprobs over the top tokens both list,
    how many they share, and whether the greedy tokens agree; with the median difference and the agreements."""
    theirs = {r["seed"]: r for r in other["rows"]}
    out = []
    for r in rows:
        o = theirs.get(r["seed"])
        if o is None:
            continue
        common = sorted(set(r["resumed_top"]) & set(o["resumed_top"]))
        diff = statistics.fmean(abs(r["resumed_top"][t] - o["resumed_top"][t]) for t in common) if common else None
        out.append({"seed": r["seed"], "cached": [r["cached"], o["cached"]], "common_top": len(common),
                    "mean_abs_difference": None if diff is None else round(diff, 4),
                    "same_greedy_token": max(r["resumed_top"], key=r["resumed_top"].get) == max(o["resumed_top"], key=o["resumed_top"].get)})
    diffs = [x["mean_abs_difference"] for x in out if x["mean_abs_difference"] is not None]
    return {"rows": out, "median_mean_abs_difference": round(statistics.median(diffs), 4) if diffs else None,
            "same_greedy_token": sum(x["same_greedy_token"] for x in out), "seeds": len(out)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(ap)
    ap.add_argument("--seeds", type=int, default=8, help="prompts (default 8)")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=1000, help="tokens of the prompt that is resumed (default 1000)")
    ap.add_argument("--more", type=int, default=300, help="tokens the resumed request adds (default 300)")
    ap.add_argument("--top", type=int, default=20, help="top tokens of each resumed distribution kept (default 20)")
    ap.add_argument("--against", default=None, help="another run's report (same seeds and sizes) to compare the resumed "
                    "distributions with, head to head")
    ap.add_argument("--out", default=None, help="write the JSON report here (else print it)")
    args = ap.parse_args()
    other = None
    if args.against:
        with open(args.against) as f:
            other = json.load(f)
        if (other.get("args", {}).get("prompt"), other.get("args", {}).get("more")) != (args.prompt, args.more):
            ap.error(f"--against {args.against} was run with --prompt/--more {other.get('args', {}).get('prompt')}/"
                     f"{other.get('args', {}).get('more')}, not {args.prompt}/{args.more}")
    client = client_from_args(args)
    info = client.get_optional("/server_info") or {}
    vocab = info.get("loaded_model", {}).get("vocab_size", 150000)
    rows = [one(client, seed, args.prompt, args.more, vocab, args.top) for seed in range(args.first_seed, args.first_seed + args.seeds)]
    report = {"bench": "resume_logprob", "time": utc_now(), "url": args.url, "settings": info.get("settings"),
              "args": {k: v for k, v in vars(args).items() if k != "api_key"}, "rows": rows,
              "median_difference": round(statistics.median(r["difference"] for r in rows), 4),
              "same_greedy_token": sum(r["same_greedy_token"] for r in rows)}
    if other is not None:
        report["against"] = {"file": args.against, **against(rows, other)}
        print(f"against {args.against}: {report['against']['median_mean_abs_difference']} median mean |difference|, "
              f"{report['against']['same_greedy_token']} of {report['against']['seeds']} greedy tokens the same", file=sys.stderr)
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
