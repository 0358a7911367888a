"""Issue 8's reliability figures for the GPU engine: one real server (``glm53 serve --engine exl3`` under gunicorn
+ gevent) on the tiny synthetic checkpoint, the same checks as the CPU tests of ``tests/server``:

- bad input: the stored schema-fuzz corpus (``tests/gpu/fuzz_corpus.json``, 150 cases over every endpoint, drawn
  from the strategies of ``tests/server/schema_fuzz.py``), token budgets capped at ``schema_fuzz.FUZZ_BUDGET`` so that every case
  is bounded; zero 5xx, no error event in a stream, and a normal request is served afterwards;
- load: 64 streaming clients on 8 batch slots, all complete, first come first served;
- a soak (SOAK_SECONDS, 60 by default; ``tests/server/soak.py``): no failure, every request and job accounted for
  in ``/metrics``, worker RSS growth after the warm-up below RSS_GROWTH_BOUND;
- clients that go away while queued, during prefill and during decode: each job is cancelled and its slot freed;
- SIGTERM (last, it stops the server): in-flight streams finish, new requests get 503, the server exits cleanly.

The figures go to ``reliability-exl3.json`` and ``reliability-exl3.md`` in REPORT_DIR (``tests/gpu/run.sh`` sets
it; else $OUT or the temporary directory).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import tempfile
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path

import pytest

from tests import loadgen
from tests.server import soak
from tests.server.schema_fuzz import FUZZ_BUDGET, GPU_CORPUS, bounded, send
from tests.server.servers import Server

SLOTS = 8
CONTEXT = 32768  # tokens; 8 jobs each reserving a 2,048-token round of pages fit with room to spare
CLIENTS = 64
CLIENT_TOKENS = 48
SOAK_S = float(os.environ.get("SOAK_SECONDS", "60"))
SOAK_CLIENTS = 12
# Above the CPU soak's 32 MiB: the CUDA runtime, Triton and exllamav3 keep host-side pools of their own
RSS_GROWTH_BOUND = 64 * 2**20
FUZZ_TIMEOUT_S = 60
PREFILL_TOKENS = 30000  # 15 chunks of 2,048: long enough to hang up while it runs
LONG = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 100000, "ignore_eos": True, "stream": True}
GRACE_S = 20


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = Server(["serve", "--engine", "exl3", "-m", str(tiny_checkpoint), "-cs", str(CONTEXT), "--max-batch-size", str(SLOTS),
                "-ambs", str(SLOTS), "-chunk_size", "2048", "--sse-keepalive-s", "0.2", "--shutdown-grace-s", str(GRACE_S)]
               ).wait_ready(timeout=600)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def figures(server):
    """What the tests measured, written as a report when the module ends (also after a failure)."""
    info = server.get("/server_info")[1]
    keys = ("engine", "mode", "cache_size", "max_batch_size", "ambs", "chunk_size", "max_queue", "shutdown_grace_s")
    out: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": info.get("gpu"),
                 "server": {k: info["settings"][k] for k in keys}, "checkpoint": "tiny synthetic (glm53 synth --preset tiny --seed 1)",
                 "model": {k: info["loaded_model"].get(k) for k in ("architecture", "decode_slots", "load_seconds")}}
    yield out
    write_report(out)


def stats(server: Server) -> dict:
    return server.get("/stats")[1]


def scheduler(server: Server) -> dict:
    return stats(server)["scheduler"]


def idle(server: Server) -> bool:
    s = stats(server)
    return s["scheduler"]["in_system"] == 0 and s["engine"]["active_jobs"] == 0 and s["engine"]["pending_jobs"] == 0


def wait_for(predicate, timeout: float, interval: float = 0.02) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        time.sleep(interval)
    return time.monotonic() - t0


# ----- bad input


def test_schema_fuzz_of_every_endpoint(server, figures):
    cases = json.loads(GPU_CORPUS.read_text())["cases"]
    seen: dict[str, Counter] = {}
    failures = []
    t0 = time.monotonic()
    for case in cases:
        method, path = case["operation"].split(" ", 1)
        body = bounded(path, case["body"])
        status, raw = send(server.port, method, case["target"], body, FUZZ_TIMEOUT_S)
        seen.setdefault(case["operation"], Counter())[status] += 1
        if status >= 500 or b'data: {"error"' in raw:
            failures.append(f"{method} {case['target']} answered {status}: {raw[-300:]!r} to {body[:300] if body else None!r}")
    took = time.monotonic() - t0
    code, r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "after the fuzz"}], "max_tokens": 8})
    wait_for(lambda: idle(server), 10)
    text = server.get("/metrics")[1]
    # /health answers 503 while the model loads (wait_ready polls it); any other 5xx is a failure
    server_errors = [line for line in text.splitlines()
                     if line.startswith("glm53_requests_total") and 'status="5' in line and 'endpoint="/health"' not in line]
    figures["fuzz"] = {"cases": len(cases), "operations": len(seen), "seconds": round(took, 1), "budget_cap": FUZZ_BUDGET,
                       "failures": len(failures), "answers": {op: dict(sorted(c.items())) for op, c in sorted(seen.items())}}
    print(f"\nfuzzed {len(cases)} cases over {len(seen)} operations in {took:.1f} s: {figures['fuzz']['answers']}")
    assert not failures, failures[:5]
    assert code == 200 and r["choices"][0]["finish_reason"] in ("stop", "length")
    assert server_errors == []


# ----- load


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": CLIENT_TOKENS, "ignore_eos": True, "seed": i,
            "stream": True, "stream_options": {"include_usage": True}}


def test_64_streaming_clients_on_8_slots_complete_first_come_first_served(server, figures):
    port = server.port
    before = loadgen.metrics(port)
    calls = [partial(loadgen.request, port, "POST", "/v1/chat/completions", chat(i), 300) for i in range(CLIENTS)]
    results = loadgen.concurrently(calls, start_gap_s=0.01)  # 10 ms apart: they arrive in the order of i
    bad = [(i, r.status, r.error, r.finish, r.completion_tokens) for i, r in enumerate(results)
           if (r.status, r.error, r.saw_done, r.finish, r.completion_tokens) != (200, None, True, "length", CLIENT_TOKENS) or r.first_token is None]
    served = [(i, r) for i, r in enumerate(results) if r.first_token is not None]
    # nobody's first token comes after that of a client who arrived two waves (16 places) later
    late = [(k, j) for k, a in served for j, b in served if j >= k + 2 * SLOTS and a.first_token > b.first_token]
    wait_for(lambda: idle(server), 10)
    after = loadgen.metrics(port)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    figures["load"] = {"clients": CLIENTS, "slots": SLOTS, "tokens_each": CLIENT_TOKENS, "errors": len(bad), "out_of_order": len(late),
                       "seconds": round(max(r.done for r in results) - min(r.sent for r in results), 2),
                       "ttft_s": soak.percentiles([r.first_token - r.sent for _, r in served]),
                       "latency_s": soak.percentiles([r.done - r.sent for r in results])}
    print(f"\n{CLIENTS} clients on {SLOTS} slots: {figures['load']}")
    assert not bad, bad
    assert not late, late[:10]
    assert delta['glm53_requests_total{endpoint="/v1/chat/completions",status="200"}'] == CLIENTS
    assert delta['glm53_jobs_finished_total{reason="length"}'] == CLIENTS
    assert delta["glm53_completion_tokens_total"] == CLIENTS * CLIENT_TOKENS


# ----- soak


def test_soak(server, figures):
    result = soak.run(server, SOAK_S, SOAK_CLIENTS)
    figures["soak"] = {**result.figures(), "rss_growth_bound_mib": soak.mib(RSS_GROWTH_BOUND)}
    print(f"\nsoak: {figures['soak']}")
    assert soak.problems(result, RSS_GROWTH_BOUND) == []


# ----- clients that go away


def open_stream(port: int, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A chat stream whose headers have arrived (a chat stream sends its first chunk even while queued)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def test_disconnect_while_queued_and_during_decode(server, figures):
    sched = partial(scheduler, server)
    holders = [open_stream(server.port, LONG) for _ in range(SLOTS)]
    wait_for(lambda: sched()["active"] == SLOTS, 10)
    conn, resp = open_stream(server.port, LONG)
    wait_for(lambda: sched()["waiting"] == 1, 10)
    before = sched()
    loadgen.hang_up(conn, resp)
    queued = wait_for(lambda: sched()["waiting"] == 0 and sched()["jobs_cancelled"] == before["jobs_cancelled"] + 1, 5)
    assert sched()["prompt_tokens"] == before["prompt_tokens"]  # it never reached the engine
    t0 = time.monotonic()
    for c, r in holders:
        loadgen.hang_up(c, r)
    wait_for(lambda: idle(server), 5)
    holders_freed = time.monotonic() - t0
    assert sched()["jobs_cancelled"] == before["jobs_cancelled"] + 1 + SLOTS

    cancelled = sched()["jobs_cancelled"]
    res = loadgen.request(server.port, "POST", "/v1/chat/completions", LONG, stop_after_chunks=5)
    assert res.chunks == 5 and res.finish is None
    decode = wait_for(lambda: idle(server) and sched()["jobs_cancelled"] == cancelled + 1, 5)
    figures.setdefault("disconnects", {}).update(
        queued_s=round(queued, 3), decode_s=round(decode, 3), all_slots_decoding_s=round(holders_freed, 3))
    assert decode < 1.0 and holders_freed < 2.0


def test_disconnect_during_prefill(server, figures):
    """A client that goes away while its prompt is prefilled: admitted (its prompt counted), no token yet."""
    rng = random.Random()  # fresh ids: a prompt the prefix cache has not seen prefills in full
    ids = [rng.randrange(1000, 150000) for _ in range(PREFILL_TOKENS)]
    before = scheduler(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": ids, "max_tokens": 4, "stream": True}), {"Content-Type": "application/json"})
    wait_for(lambda: scheduler(server)["prompt_tokens"] - before["prompt_tokens"] == len(ids), 10, interval=0.002)
    loadgen.hang_up(conn)
    took = wait_for(lambda: idle(server) and scheduler(server)["jobs_cancelled"] == before["jobs_cancelled"] + 1, 5)
    after = scheduler(server)
    assert after["completion_tokens"] == before["completion_tokens"], "the prefill ended before the client went away: use a longer prompt"
    assert after["prefix_cache_misses"] == before["prefix_cache_misses"]  # no prefill completed
    figures.setdefault("disconnects", {})["prefill_s"] = round(took, 3)
    assert took < 1.0
    code, r = server.post("/v1/completions", {"prompt": "after a disconnect", "max_tokens": 4})
    assert code == 200 and r["usage"]["completion_tokens"] >= 1


# ----- SIGTERM (last: it stops the server)


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(server, figures):
    tokens = 500
    body = {"messages": [{"role": "user", "content": "drain"}], "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    results: list = [None] * 3

    def run(i: int) -> None:
        results[i] = loadgen.request(server.port, "POST", "/v1/chat/completions", body, timeout=60)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: scheduler(server)["active"] == 3, 10)
    t_term = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    health = loadgen.request(server.port, "GET", "/health")
    while health.status == 200 and time.monotonic() - t_term < 2:
        health = loadgen.request(server.port, "GET", "/health")
    refused = loadgen.request(server.port, "POST", "/v1/completions", {"prompt": "too late", "max_tokens": 2})
    for t in threads:
        t.join(GRACE_S + 10)
    streams_done = max(r.done for r in results) - t_term
    server.proc.wait(GRACE_S + 10)
    exited = time.monotonic() - t_term
    figures["drain"] = {"streams": 3, "tokens_each": tokens, "streams_done_s": round(streams_done, 2), "exited_s": round(exited, 2),
                        "grace_s": GRACE_S, "exit_code": server.proc.returncode}
    print(f"\ndrain: {figures['drain']}")
    assert (health.status, health.body) == (503, {"status": "draining"})
    assert refused.status == 503 and refused.headers["retry-after"] == "5" and refused.body["error"]["code"] == "shutting_down"
    for r in results:
        assert (r.status, r.error, r.finish, r.completion_tokens, r.saw_done) == (200, None, "length", tokens, True)
    assert server.proc.returncode == 0 and exited < GRACE_S
    assert re.search(r"draining \d request\(s\) in flight", server.log()) and "drained in" in server.log()


# ----- the report


def report_dir() -> Path:
    return Path(os.environ.get("REPORT_DIR") or os.environ.get("OUT") or tempfile.gettempdir())


def write_report(fig: dict) -> None:
    out = report_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "reliability-exl3.json").write_text(json.dumps(fig, indent=2) + "\n")
    (out / "reliability-exl3.md").write_text(markdown(fig))


def markdown(fig: dict) -> str:
    gpu = fig.get("gpu") or {}
    lines = [
        "# Reliability on the GPU engine (issue 8)", "",
        f"- date: {fig['date']}; command: `tests/gpu/run.sh -k test_reliability_exl3`",
        (f"- GPU: {gpu.get('name')}, {gpu.get('total_memory_gb')} GB, compute capability {gpu.get('compute_capability')}, "
         f"driver {gpu.get('driver_version')}, CUDA {gpu.get('cuda_driver_version')} (driver) / {gpu.get('cuda_runtime_version')} (torch)"),
        f"- server: `glm53 serve` with {fig['server']}; checkpoint: {fig['checkpoint']}; model: {fig['model']}", "",
        "| check | figures |", "|---|---|",
    ]
    for name, describe in (("fuzz", _fuzz_line), ("load", _load_line), ("soak", _soak_line), ("disconnects", _disconnect_line),
                           ("drain", _drain_line)):
        lines.append(f"| {name} | {describe(fig[name]) if name in fig else 'not measured (the test failed first, or did not run)'} |")
    return "\n".join(lines) + "\n"


def _spread(p: dict) -> str:
    return f"p50 {p['p50']} s, p99 {p['p99']} s" if p.get("n") else "none"


def _fuzz_line(f: dict) -> str:
    answers = "; ".join(f"{op}: " + ", ".join(f"{status} x{n}" for status, n in c.items()) for op, c in f["answers"].items())
    return (f"{f['cases']} cases over {f['operations']} operations in {f['seconds']} s (token budgets capped at {f['budget_cap']}); "
            f"{f['failures']} with a 5xx or an error event. Answers: {answers}")


def _load_line(f: dict) -> str:
    return (f"{f['clients']} streaming clients on {f['slots']} slots, {f['tokens_each']} tokens each: {f['clients'] - f['errors']} complete "
            f"in {f['seconds']} s, {f['out_of_order']} served out of order; time to first token {_spread(f['ttft_s'])}; "
            f"latency {_spread(f['latency_s'])}")


def _soak_line(f: dict) -> str:
    rss = f["rss_mib"]
    return (f"{f['seconds']} s, {f['clients']} clients, {f['requests']} requests {f['kinds']}, {f['failures']} failures; worker RSS "
            f"{rss['start']} MiB at start, {rss['after_warmup']} after the warm-up, {rss['end']} at the end, peak {rss['peak']}: "
            f"growth {rss['growth_after_warmup']} MiB (bound {f['rss_growth_bound_mib']}); latency {_spread(f['latency_s'])}; "
            f"time to first token {_spread(f['ttft_s'])}")


def _disconnect_line(f: dict) -> str:
    phases = ", ".join(f"{phase} {f[key]} s" for phase, key in (("queued", "queued_s"), ("prefill", "prefill_s"), ("decode", "decode_s"))
                       if key in f)
    extra = f"; all {SLOTS} decoding slots at once: {f['all_slots_decoding_s']} s" if "all_slots_decoding_s" in f else ""
    return f"job cancelled and its slot freed after the client went away: {phases}{extra}"


def _drain_line(f: dict) -> str:
    return (f"{f['streams']} streams of {f['tokens_each']} tokens in flight at SIGTERM finished {f['streams_done_s']} s after it; "
            f"new requests got 503; the server exited after {f['exited_s']} s (grace {f['grace_s']} s) with code {f['exit_code']}")
