#!/usr/bin/env python3
"""Streaming delivery check: is text delivered evenly while it is generated, or in bursts?

Streams one long greedy answer through ``/v1/chat/completions`` (thinking off) and through ``/generate`` (the
same prompt, tokenised by ``/tokenize``), records when each content-bearing event arrives and how much text it
carries, and passes when, on both paths, at least 40 % of the final text had arrived by the time midpoint and at
most 20 % arrived in the last tenth of the stream's time (an even stream: 50 % and 10 %). A server that awaits
something per event delivers about a quarter by the midpoint and a burst at the end. The tail is a share of the
stream's own time, not a fixed second, so that a fast machine's short stream is judged as a slow one's long one.

Python standard library only; works against any server with these endpoints.
Prints a JSON report; exit code 0 on pass, 1 on fail.
"""

from __future__ import annotations

import argparse
import json
import sys

from client import Client, add_server_args, chat_prompt, client_from_args

PROMPT = "Write a detailed essay of at least 1200 words on the history of the printing press."
HALF_MIN = 0.40
TAIL_MAX = 0.20


def chat_arrivals(client: Client, args) -> list[tuple[float, int]]:
    """(arrival time, cumulative characters) for each chat chunk that carries text."""
    body = {
        "model": args.model, "messages": [{"role": "user", "content": PROMPT}], "stream": True, "temperature": 0,
        "max_tokens": args.max_tokens, "chat_template_kwargs": {"enable_thinking": False},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    total, out = 0, []
    for t, chunk in client.stream("/v1/chat/completions", body):
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            n = len(delta.get("content") or "") + len(delta.get("reasoning_content") or "")
            if n:
                total += n
                out.append((t, total))
    return out


def generate_arrivals(client: Client, args) -> list[tuple[float, int]]:
    """The same for ``/generate``, whose events carry the cumulative text."""
    ids = client.post("/tokenize", {"text": chat_prompt(PROMPT)})["tokens"]
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}}
    last, out = 0, []
    for t, chunk in client.stream("/generate", body):
        n = len(chunk.get("text", ""))
        if n > last:
            last = n
            out.append((t, n))
    return out


def shares(arrivals: list[tuple[float, int]]) -> dict:
    """half_share: text by the midpoint between the first and the last event (time to first token, which long
    prompts stretch, does not count); tail_share: text in the last tenth of that time."""
    if not arrivals:
        return {"events": 0, "chars": 0, "seconds": 0.0, "half_share": 0.0, "tail_share": 1.0}
    t_start = arrivals[0][0]
    t_end, total = arrivals[-1]
    mid = t_start + (t_end - t_start) / 2
    by_mid = max((c for t, c in arrivals if t <= mid), default=0)
    before_tail = max((c for t, c in arrivals if t <= t_end - (t_end - t_start) / 10), default=0)
    return {
        "events": len(arrivals),
        "chars": total,
        "seconds": round(t_end - t_start, 3),
        "half_share": round(by_mid / total, 4),
        "tail_share": round((total - before_tail) / total, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(ap)
    ap.add_argument("--model", default="glm-5.3-flash")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (for models that stop early)")
    args = ap.parse_args(argv)
    client = client_from_args(args)
    paths = []
    for name, fn in (("chat", chat_arrivals), ("generate", generate_arrivals)):
        report = {"path": name, **shares(fn(client, args))}
        report["pass"] = report["half_share"] >= HALF_MIN and report["tail_share"] <= TAIL_MAX and report["chars"] > 0
        paths.append(report)
    result = {"url": client.base, "max_tokens": args.max_tokens, "criteria": {"half_share_min": HALF_MIN, "tail_share_max": TAIL_MAX},
              "paths": paths, "pass": all(p["pass"] for p in paths)}
    print(json.dumps(result, indent=2))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
