"""A bounded soak against a running server, shared by the CPU soak (``test_soak.py``) and the GPU one
(``tests/gpu/test_reliability_exl3.py``): CLIENTS loops over a mix of every generating endpoint, streamed and
not, with clients that hang up mid-stream, while the worker's resident memory is sampled every second.

:func:`run` returns what happened; :func:`problems` says what is wrong with it (a failed request, a request or
job that ``/metrics`` does not account for exactly, memory that grew after the warm-up).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from tests import loadgen

from .servers import Server

WARMUP_SHARE = 0.25  # RSS is compared from the end of the first quarter: allocator pools and caches fill up first
HANG_UP_AFTER = 3  # chunks; those clients ask for far more tokens, so their job is surely still running


@dataclass
class Soak:
    seconds: float
    clients: int
    counts: Counter = field(default_factory=Counter)  # (endpoint, status) -> requests
    kinds: Counter = field(default_factory=Counter)  # kind of request in the mix -> requests
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # seconds, of the completed generating requests
    ttfts: list[float] = field(default_factory=list)  # seconds to the first token, of the completed streams
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the start, worker RSS in bytes)
    metrics_delta: dict[str, float] = field(default_factory=dict)  # /metrics after minus before

    @property
    def requests(self) -> int:
        return sum(self.counts.values())

    def rss_after_warmup(self) -> tuple[int, int]:
        """Worker RSS (median of three samples) at the end of the warm-up and at the end of the soak."""
        warm = [b for t, b in self.rss if t >= WARMUP_SHARE * self.seconds]
        return int(statistics.median(warm[:3])), int(statistics.median(warm[-3:]))

    def figures(self) -> dict:
        start, end = self.rss_after_warmup()
        return {
            "seconds": round(self.seconds, 1), "clients": self.clients, "requests": self.requests, "kinds": dict(self.kinds),
            "failures": len(self.failures),
            "rss_mib": {"start": mib(self.rss[0][1]), "after_warmup": mib(start), "end": mib(end), "peak": mib(max(b for _, b in self.rss)),
                        "growth_after_warmup": mib(end - start)},
            "latency_s": percentiles(self.latencies), "ttft_s": percentiles(self.ttfts),
        }


def mib(n: float) -> float:
    return round(n / 2**20, 1)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(ordered), "p50": round(statistics.median(ordered), 4), "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4),
            "max": round(ordered[-1], 4)}


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


def run(server: Server, seconds: float, clients: int) -> Soak:
    """Soak ``server`` for ``seconds`` with ``clients`` concurrent clients; then wait until it holds no job."""
    port = server.port
    pid = loadgen.worker_pid(server.proc.pid)
    before = loadgen.metrics(port)
    soak = Soak(seconds, clients)
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()
    t0 = time.monotonic()

    def client(i: int) -> None:
        rng = random.Random(i)
        n = 0
        while time.monotonic() < stop_at:
            kind, endpoint, res = one_request(port, rng, i * 100000 + n)
            n += 1
            with lock:
                # the server counts a client that hung up as 499 (client closed request), whatever it had sent
                soak.counts[(endpoint, 499 if kind == "hang_up" else res.status)] += 1
                soak.kinds[kind] += 1
                problem = failure(kind, res)
                if problem:
                    soak.failures.append(problem)
                elif kind not in ("tokenize", "hang_up"):
                    soak.latencies.append(res.done - res.sent)
                    if res.first_token is not None and res.saw_done:
                        soak.ttfts.append(res.first_token - res.sent)

    def sample_rss() -> None:
        while time.monotonic() < stop_at:
            soak.rss.append((time.monotonic() - t0, loadgen.rss_bytes(pid)))
            time.sleep(1.0)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    loadgen.concurrently([lambda i=i: client(i) for i in range(clients)], timeout=seconds + 120)
    sampler.join(5)
    soak.seconds = time.monotonic() - t0

    deadline = time.monotonic() + 10  # cancelled jobs leave at the scheduler's next step
    while server.get("/stats")[1]["scheduler"]["in_system"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = loadgen.metrics(port)
    soak.metrics_delta = {k: after[k] - before.get(k, 0) for k in after}
    return soak


def problems(soak: Soak, rss_growth_bound: int) -> list[str]:
    """Everything wrong with a soak: failed requests, inexact accounting in ``/metrics``, RSS growth past the bound."""
    out = list(soak.failures[:10])
    delta = soak.metrics_delta
    for (endpoint, status), n in soak.counts.items():
        counted = delta.get(f'glm53_requests_total{{endpoint="{endpoint}",status="{status}"}}')
        if counted != n:
            out.append(f"{n} requests to {endpoint} answered {status}, /metrics counted {counted}")
    generating = sum(n for k, n in soak.kinds.items() if k not in ("tokenize", "hang_up"))
    ended = delta['glm53_jobs_finished_total{reason="stop"}'] + delta['glm53_jobs_finished_total{reason="length"}']
    if ended != generating:
        out.append(f"{generating} generating requests completed, /metrics counted {ended} jobs that stopped or hit their length")
    cancelled = delta['glm53_jobs_finished_total{reason="cancelled"}']
    if cancelled != soak.kinds["hang_up"]:
        out.append(f"{soak.kinds['hang_up']} clients hung up, /metrics counted {cancelled} cancelled jobs")
    if delta['glm53_jobs_finished_total{reason="error"}'] or delta["glm53_engine_errors_total"]:
        out.append("jobs ended with an error")
    start, end = soak.rss_after_warmup()
    if end - start >= rss_growth_bound:
        out.append(f"worker RSS grew {mib(end - start)} MiB after the warm-up (bound {mib(rss_growth_bound)} MiB)")
    return out
