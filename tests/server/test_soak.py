"""A bounded soak of the CPU demo model over real gunicorn + gevent: a mix of every generating endpoint, streamed
and not, with clients that hang up mid-stream, for SOAK_SECONDS (60 in CI; set the environment variable for a
longer manual run). No request may fail, the worker's resident memory must stay flat after a warm-up, and
``/metrics`` must account for every request and every job.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections import Counter

import pytest

from tests import loadgen

from .servers import Server

SOAK_S = float(os.environ.get("SOAK_SECONDS", "60"))
CLIENTS = 12
WARMUP_SHARE = 0.25  # RSS is compared from the end of the first quarter: allocator pools and caches fill up first
RSS_GROWTH_BOUND = 32 * 2**20
HANG_UP_AFTER = 3  # chunks; those clients ask for far more tokens, so their job is surely still running


@pytest.fixture(scope="module")
def server():
    s = Server(["serve", "--engine", "tiny", "--max-batch-size", "8", "-cs", "2048"]).wait_ready()
    yield s
    s.stop()


def one_request(port: int, rng: random.Random, tag: int) -> tuple[str, str, loadgen.Result]:
    """(kind, endpoint, result) of one request drawn from the mix."""
    tokens = rng.randint(4, 40)
    messages = [{"role": "user", "content": f"soak {tag}"}]
    kind = rng.choices(["chat_stream", "chat", "completion", "generate", "tokenize", "hang_up"], [40, 15, 15, 10, 10, 10])[0]
    if kind == "chat_stream":
        body = {"messages": messages, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
        return kind, "/v1/chat/completions", loadgen.request(port, "POST", "/v1/chat/completions", body)
    if kind == "chat":
        return kind, "/v1/chat/completions", loadgen.request(port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": tokens})
    if kind == "completion":
        body = {"prompt": f"soak {tag}", "max_tokens": tokens, "stream": rng.random() < 0.5, "stream_options": None}
        body = {k: v for k, v in body.items() if v is not None}
        return kind, "/v1/completions", loadgen.request(port, "POST", "/v1/completions", body)
    if kind == "generate":
        body = {"text": f"soak {tag}", "sampling_params": {"max_new_tokens": tokens}}
        return kind, "/generate", loadgen.request(port, "POST", "/generate", body)
    if kind == "tokenize":
        return kind, "/tokenize", loadgen.request(port, "POST", "/tokenize", {"text": f"soak {tag} " * tokens})
    body = {"messages": messages, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    return kind, "/v1/chat/completions", loadgen.request(port, "POST", "/v1/chat/completions", body, stop_after_chunks=HANG_UP_AFTER)


def failure(kind: str, res: loadgen.Result) -> str | None:
    if res.status != 200:
        return f"{kind}: status {res.status} {res.body or res.error}"
    if kind == "hang_up":
        return None if res.chunks >= HANG_UP_AFTER else f"hang_up: only {res.chunks} chunks"
    if res.error:
        return f"{kind}: {res.error}"
    streamed = res.headers.get("content-type", "").startswith("text/event-stream")
    if streamed and not (res.saw_done and res.finish in ("stop", "length")):
        return f"{kind}: stream ended without a finish and [DONE]"
    return None


def test_soak(server):
    port = server.port
    pid = loadgen.worker_pid(server.proc.pid)
    before = loadgen.metrics(port)
    stop_at = time.monotonic() + SOAK_S
    counts: Counter = Counter()  # (endpoint, status)
    kinds: Counter = Counter()
    failures: list[str] = []
    rss: list[tuple[float, int]] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def client(i: int) -> None:
        rng = random.Random(i)
        n = 0
        while time.monotonic() < stop_at:
            kind, endpoint, res = one_request(port, rng, i * 100000 + n)
            n += 1
            with lock:
                counts[(endpoint, res.status)] += 1
                kinds[kind] += 1
                problem = failure(kind, res)
                if problem:
                    failures.append(problem)

    def sample_rss() -> None:
        while time.monotonic() < stop_at:
            rss.append((time.monotonic() - t0, loadgen.rss_bytes(pid)))
            time.sleep(1.0)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    loadgen.concurrently([lambda i=i: client(i) for i in range(CLIENTS)], timeout=SOAK_S + 120)
    sampler.join(5)
    elapsed = time.monotonic() - t0
    assert not failures, failures[:10]

    deadline = time.monotonic() + 10  # cancelled jobs leave at the scheduler's next step
    while server.get("/stats")[1]["scheduler"]["in_system"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = loadgen.metrics(port)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    for (endpoint, status), n in counts.items():
        assert delta[f'glm53_requests_total{{endpoint="{endpoint}",status="{status}"}}'] == n, (endpoint, status)
    generating = sum(n for k, n in kinds.items() if k not in ("tokenize", "hang_up"))
    assert delta['glm53_jobs_finished_total{reason="stop"}'] + delta['glm53_jobs_finished_total{reason="length"}'] == generating
    assert delta['glm53_jobs_finished_total{reason="cancelled"}'] == kinds["hang_up"]
    assert delta['glm53_jobs_finished_total{reason="error"}'] == 0 and delta["glm53_engine_errors_total"] == 0

    warm = [b for t, b in rss if t >= WARMUP_SHARE * SOAK_S]
    start, end = statistics.median(warm[:3]), statistics.median(warm[-3:])
    print(f"\nsoak: {elapsed:.0f} s, {CLIENTS} clients, {sum(counts.values())} requests {dict(kinds)}, 0 failures; "
          f"worker RSS {rss[0][1] / 2**20:.0f} MiB at start, {start / 2**20:.0f} MiB after warm-up, {end / 2**20:.0f} MiB at the end "
          f"(growth {(end - start) / 2**20:+.1f} MiB, peak {max(b for _, b in rss) / 2**20:.0f} MiB)")
    assert end - start < RSS_GROWTH_BOUND, f"worker RSS grew {(end - start) / 2**20:.1f} MiB after warm-up"
