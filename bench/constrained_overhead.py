#!/usr/bin/env python3
"""Decode-rate cost of constrained decoding: a JSON-schema answer against a free one of the same length.

For each stream count (default 1 and 4), runs that many concurrent streamed chat requests (thinking off, greedy)
held to a JSON schema that makes a long answer (an array of ``--items`` bounded strings), then as many free
requests of exactly the same number of tokens (``max_tokens`` set to the constrained answer's length,
``ignore_eos``), alternating the two ``--repeats`` times. A stream's decode rate is its tokens after the first
over the time from its first content event to its last, so prefill and queueing do not count. Reports the
median per-stream and aggregate rates of each kind and the overhead, 1 - constrained / free (the issue's goal:
at most 5 % at one stream).

Python standard library only. Prints (or writes with --out) a JSON report; exit code 0 unless a request fails.

    python3 bench/constrained_overhead.py --url http://127.0.0.1:30000 --out bench/results/DATE-constrained-overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from client import Client, add_server_args, client_from_args, utc_now, write_json

PROMPT = "List product names, one short phrase each, as a JSON array of strings."


def schema(items: int) -> dict:
    return {"type": "array", "items": {"type": "string", "minLength": 4, "maxLength": 24}, "minItems": items, "maxItems": items}


def one_stream(client: Client, body: dict) -> dict:
    """Stream one chat request: its completion tokens, decode seconds and finish_reason."""
    first = last = None
    usage, finish = None, None
    for t, chunk in client.stream("/v1/chat/completions", body):
        for choice in chunk.get("choices", []):
            if choice.get("delta", {}).get("content"):
                first = t if first is None else first
                last = t
            finish = choice.get("finish_reason") or finish
        usage = chunk.get("usage") or usage
    tokens = usage["completion_tokens"]
    return {"tokens": tokens, "seconds": (last - first) if first is not None else 0.0, "finish": finish}


def run_streams(client: Client, bodies: list[dict]) -> list[dict]:
    """Run the requests concurrently; their results in order. :raise the first request's failure:"""
    results: list[dict | BaseException | None] = [None] * len(bodies)

    def work(i: int) -> None:
        try:
            results[i] = one_stream(client, bodies[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(bodies))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def rates(results: list[dict]) -> tuple[float, float]:
    """(median per-stream decode tok/s, aggregate tok/s over the longest stream's time)."""
    per = [(r["tokens"] - 1) / r["seconds"] for r in results if r["seconds"] > 0]
    span = max(r["seconds"] for r in results)
    return statistics.median(per), sum(r["tokens"] - 1 for r in results) / span


def measure(client: Client, args, streams: int) -> dict:
    base = {"model": args.model, "messages": [{"role": "user", "content": PROMPT}], "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}
    fmt = {"type": "json_schema", "json_schema": {"name": "products", "schema": schema(args.items), "strict": True}}
    held = {"per_stream": [], "aggregate": []}
    free = {"per_stream": [], "aggregate": []}
    lengths = []
    for _ in range(args.repeats):
        constrained = run_streams(client, [{**base, "max_tokens": args.max_tokens, "response_format": fmt, "seed": i} for i in range(streams)])
        if any(r["finish"] != "stop" for r in constrained):
            raise RuntimeError(f"a constrained answer did not complete within {args.max_tokens} tokens: {constrained}")
        length = min(r["tokens"] for r in constrained)
        lengths.append(length)
        unconstrained = run_streams(client, [{**base, "max_tokens": length, "ignore_eos": True} for _ in range(streams)])
        for kind, results in ((held, constrained), (free, unconstrained)):
            per, aggregate = rates(results)
            kind["per_stream"].append(per)
            kind["aggregate"].append(aggregate)
    out = {"streams": streams, "answer_tokens": lengths}
    for name, kind in (("constrained", held), ("free", free)):
        out[name] = {k: round(statistics.median(v), 3) for k, v in kind.items()}
    out["overhead_per_stream"] = round(1 - out["constrained"]["per_stream"] / out["free"]["per_stream"], 4)
    out["overhead_aggregate"] = round(1 - out["constrained"]["aggregate"] / out["free"]["aggregate"], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(ap)
    ap.add_argument("--model", default="glm-5.3-flash")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4], help="concurrent streams per measurement")
    ap.add_argument("--items", type=int, default=48, help="strings in the constrained answer's array")
    ap.add_argument("--max-tokens", type=int, default=4096, help="cap of a constrained answer (it must finish within)")
    ap.add_argument("--repeats", type=int, default=3, help="constrained/free pairs per stream count (medians are reported)")
    ap.add_argument("--out", default=None, help="write the JSON report here instead of printing it")
    args = ap.parse_args(argv)
    client = client_from_args(args)
    t0 = time.monotonic()
    results = [measure(client, args, n) for n in args.streams]
    report = {"date": utc_now(), "url": client.base, "server_info": client.get_optional("/server_info"),
              "command": " ".join(["bench/constrained_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
              "items": args.items, "repeats": args.repeats, "results": results,
              "goal": "overhead_per_stream <= 0.05 at one stream", "seconds": round(time.monotonic() - t0, 1)}
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
