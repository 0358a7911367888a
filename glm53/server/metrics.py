"""Request metrics and their Prometheus text rendering (no client library: the format is four line types).

Counters are updated by request greenlets; the scheduler's and the backend's own figures are read at scrape
time, so /metrics and /stats always agree with the engine.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from .unknown_fields import UnknownFields

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()  # a greenlet lock under gevent; a real one under a threaded server
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (endpoint, status) -> count
        self.ttft = Histogram(TTFT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.unknown_fields = UnknownFields()

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def completed(self, seconds: float) -> None:
        with self._lock:
            self.latency.observe(seconds)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": {f"{e} {s}": n for (e, s), n in sorted(self.requests.items())},
                "requests_total": sum(self.requests.values()),
                "ttft_seconds_mean": self.ttft.sum / self.ttft.total if self.ttft.total else None,
                "request_seconds_mean": self.latency.sum / self.latency.total if self.latency.total else None,
            }

    def render(self, scheduler: dict, engine: dict) -> str:
        """Prometheus text exposition format 0.0.4."""
        out: list[str] = []
        with self._lock:
            out.append("# HELP glm53_requests_total HTTP requests by endpoint and status.")
            out.append("# TYPE glm53_requests_total counter")
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f'glm53_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            _histogram(out, "glm53_time_to_first_token_seconds", "Time from request to first generated token.", self.ttft)
            _histogram(out, "glm53_request_seconds", "Time from request to the end of its completion.", self.latency)
        out += self.unknown_fields.render()
        _gauge(out, "glm53_queue_depth", "Jobs waiting for a batch slot.", scheduler["waiting"])
        _gauge(out, "glm53_running_jobs", "Jobs being generated.", scheduler["active"])
        _gauge(out, "glm53_model_ready", "1 when the model is loaded.", int(scheduler["state"] == "ready"))
        _gauge(out, "glm53_decode_tokens_per_second", "Tokens per second over the recent engine steps (all jobs).", scheduler["decode_tokens_per_second"] or 0.0)
        _counter(out, "glm53_prompt_tokens_total", "Prompt tokens admitted.", scheduler["prompt_tokens"])
        _counter(out, "glm53_completion_tokens_total", "Tokens generated.", scheduler["completion_tokens"])
        _counter(out, "glm53_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache (counted when a prefill completes).",
                 scheduler["prefix_cache_hits"])
        _counter(out, "glm53_prefix_cache_miss_tokens_total", "Prompt tokens prefilled (counted when a prefill completes).",
                 scheduler["prefix_cache_misses"])
        _gauge(out, "glm53_prefix_cache_hit_rate", "Share of prefix-cache hit tokens among all prompt tokens counted so far (0 before any).",
               scheduler["prefix_cache_hit_rate"] or 0.0)
        _counter(out, "glm53_engine_steps_total", "Engine forward steps.", scheduler["steps"])
        _counter(out, "glm53_engine_errors_total", "Engine steps that failed (every active job ended with an error).", scheduler["engine_errors"])
        _counter(out, "glm53_sequence_errors_total", "Jobs the engine failed alone (the rest of their batch went on).", scheduler["sequence_errors"])
        out.append("# HELP glm53_jobs_finished_total Jobs by how they ended.")
        out.append("# TYPE glm53_jobs_finished_total counter")
        for reason in ("stop", "length", "cancelled", "error"):
            out.append(f'glm53_jobs_finished_total{{reason="{reason}"}} {scheduler["jobs_" + reason]}')
        _counter(out, "glm53_jobs_rejected_total", "Requests refused with 429 (queue full).", scheduler["jobs_rejected"])
        for name, value in _flatten(engine):
            _gauge(out, f"glm53_engine_{name}", "Backend figure (see /stats).", value)
        for name, series in _per_layer(engine):
            metric = f"glm53_engine_{name}"
            out += [f"# HELP {metric} Backend figure per MoE layer (see /stats).", f"# TYPE {metric} gauge"]
            out += [f'{metric}{{layer="{layer}"}} {value}' for layer, value in series]
        return "\n".join(out) + "\n"


def _gauge(out: list[str], name: str, help_: str, value: float) -> None:
    out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value}"]


def _counter(out: list[str], name: str, help_: str, value: float) -> None:
    out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]


def _histogram(out: list[str], name: str, help_: str, h: Histogram) -> None:
    out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    for bound, count in zip(h.buckets, h.counts):
        out.append(f'{name}_bucket{{le="{bound}"}} {count}')
    out += [f'{name}_bucket{{le="+Inf"}} {h.total}', f"{name}_sum {h.sum}", f"{name}_count {h.total}"]


def _flatten(stats: dict, prefix: str = ""):
    """Numeric leaves of a nested stats dict as (metric_name, value); lists and text are left to /stats."""
    for key, value in stats.items():
        name = f"{prefix}{key}".replace(".", "_").replace("-", "_")
        if isinstance(value, bool):
            yield name, int(value)
        elif isinstance(value, (int, float)):
            yield name, value
        elif isinstance(value, dict):
            yield from _flatten(value, name + "_")


def _per_layer(stats: dict, prefix: str = ""):
    """Lists of per-layer dicts (``[{"layer": key, "hits": 3, ...}]``, such as the expert cache's) as
    (metric_name, [(layer, value)]) per numeric field: one labelled series per layer."""
    for key, value in stats.items():
        name = f"{prefix}{key}".replace(".", "_").replace("-", "_")
        if isinstance(value, dict):
            yield from _per_layer(value, name + "_")
        elif isinstance(value, list) and value and all(isinstance(v, dict) and isinstance(v.get("layer"), str) for v in value):
            fields = [f for f in value[0] if f != "layer"]
            for field in fields:
                series = [(v["layer"], v[field]) for v in value
                          if isinstance(v.get(field), (int, float)) and not isinstance(v.get(field), bool)]
                if series:
                    yield f"{name}_{field}", series
