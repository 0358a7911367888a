"""What the fleet's router costs: its added latency per request and its TTFT cost, and an agent's second-turn cache
reuse through it against one box's.

Starts a fleet on loopback (``bench/fleet.py``: N demo-model replicas behind ``sglang-router``, a shared Redis) and
sends the same requests, alternately, straight to a replica and through the router, one at a time so that neither
queues behind the other:

* latency: a non-streamed completion of one token (the router's whole round trip: accept, parse the body, pick a
  replica by prefix match, forward, relay the answer);
* TTFT: a streamed chat completion, from sending to the first content event;
* reuse: a five-turn agent conversation through the router, and the same shape of conversation sent to one replica
  directly; each turn's cached prompt tokens over its prompt tokens.

The demo model's own times are small (milliseconds), so the router's share is measured against a fast server; with
the real model it is the same milliseconds against seconds of prefill.

    python -m bench.fleet_router --out bench/results/DATE-fleet-router-HOST.json --md bench/results/...md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request

from bench.client import percentile, utc_now, write_json
from bench.fleet import MODEL, Fleet


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def request_seconds(url: str, i: int) -> float:
    body = {"model": MODEL, "prompt": f"Request {i}: the build log says ", "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    post(url, "/v1/completions", body)
    return time.perf_counter() - start


def ttft_seconds(url: str, i: int) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Stream {i}: say something."}], "max_tokens": 8,
            "temperature": 0, "stream": True, "chat_template_kwargs": {"enable_thinking": False}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            text = line.decode().strip()
            if first is None and text.startswith("data: {") and '"content"' in text:
                first = time.perf_counter() - start
    return first


def conversation_reuse(url: str, name: str, turns: int) -> list[float]:
    """Per turn, cached prompt tokens / prompt tokens of a conversation that repeats all of itself each turn."""
    messages = [{"role": "system", "content": f"{name} is a coding agent. " + "It reads the files, runs the tests and reports back. " * 12}]
    ratios = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: run the next step of the plan and show me the output."})
        answer = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0})
        usage = answer["usage"]
        ratios.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
    return ratios


def summary(seconds: list[float]) -> dict:
    ms = [1000 * s for s in seconds]
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3), "p90_ms": round(percentile(ms, 90), 3),
            "mean_ms": round(statistics.fmean(ms), 3)}


def measure(fleet: Fleet, n: int, warmup: int) -> dict:
    direct, routed = fleet.urls[0], fleet.url
    for i in range(warmup):
        request_seconds(direct, -i), request_seconds(routed, -i), ttft_seconds(direct, -i), ttft_seconds(routed, -i)
    lat = {"direct": [], "router": []}
    ttft = {"direct": [], "router": []}
    for i in range(n):
        # alternate the order, so neither path always runs on a cache the other warmed
        for path, url in ((("direct", direct), ("router", routed)) if i % 2 else (("router", routed), ("direct", direct))):
            lat[path].append(request_seconds(url, i))
            ttft[path].append(ttft_seconds(url, i))
    out = {"latency": {k: summary(v) for k, v in lat.items()}, "ttft": {k: summary(v) for k, v in ttft.items()}}
    for kind in ("latency", "ttft"):
        out[kind]["router_added_median_ms"] = round(out[kind]["router"]["median_ms"] - out[kind]["direct"]["median_ms"], 3)
    routed_reuse = conversation_reuse(routed, "Ayla", 5)
    single_reuse = conversation_reuse(direct, "Brun", 5)
    out["agent_reuse"] = {"router": [round(r, 4) for r in routed_reuse], "single_box": [round(r, 4) for r in single_reuse],
                          "second_turn_ratio": round(routed_reuse[1] / single_reuse[1], 4)}
    return out


def to_markdown(result: dict) -> str:
    m = result["measured"]
    rows = [(f"| {kind} | {m[kind]['direct']['median_ms']} | {m[kind]['router']['median_ms']} | {m[kind]['router_added_median_ms']} | "
             f"{m[kind]['direct']['p90_ms']} | {m[kind]['router']['p90_ms']} |") for kind in ("latency", "ttft")]
    return "\n".join([
        f"# Fleet router cost ({result['host']['label']}, {result['date']})",
        "",
        (f"{result['replicas']} demo-model replicas (`--engine tiny`) behind sglang-router {result['router_version']} "
         f"(cache-aware), loopback, one request at a time, {m['latency']['router']['n']} of each kind per path. "
         f"Command: `{result['command']}`."),
        "",
        "| ms | direct median | via router median | router adds (median) | direct p90 | via router p90 |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        ("`latency`: a one-token non-streamed completion, send to last byte. `ttft`: a streamed chat completion, send "
         "to the first content event."),
        "",
        result["note"],
        "",
        (f"Agent conversation, cached / prompt tokens per turn: via the router {m['agent_reuse']['router']}, one box "
         f"{m['agent_reuse']['single_box']}; second turn through the router / one box = {m['agent_reuse']['second_turn_ratio']}."),
        "",
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--n", type=int, default=60, help="requests of each kind per path")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--host-label", default=platform.node(), help="what the results call this machine")
    ap.add_argument("--note", default="", help="a sentence on the conditions, kept in both outputs")
    ap.add_argument("--out", default=None, help="JSON result (default: print)")
    ap.add_argument("--md", default=None, help="also write the Markdown summary here")
    args = ap.parse_args(argv)
    from importlib.metadata import version

    with Fleet(replicas=args.replicas) as fleet:
        measured = measure(fleet, args.n, args.warmup)
    result = {
        "bench": "fleet_router", "date": utc_now(), "replicas": args.replicas, "router_version": version("sglang-router"),
        "host": {"label": args.host_label, "cpus": os.cpu_count(), "machine": platform.machine()},
        "command": "python -m bench.fleet_router " + " ".join(argv if argv is not None else sys.argv[1:]),
        "note": args.note, "measured": measured,
    }
    write_json(result, args.out)
    if args.md:
        with open(args.md, "w") as f:
            f.write(to_markdown(result))


if __name__ == "__main__":
    main()
