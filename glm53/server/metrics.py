"""Request metrics and ``/metrics``, through ``prometheus_client``: one registry per app (two apps in one process,
as in tests, never share a series), the process and Python figures the library collects, and the exposition
format the scraper asks for in ``Accept`` (OpenMetrics 1.0 or the Prometheus text format; text 0.0.4 when it asks
for neither).

Request counters and histograms are updated by request greenlets; the scheduler's and the backend's own figures are
read at scrape time (:class:`_EngineFigures`), so /metrics and /stats always agree with the engine. The series
names and labels are those of the hand-written text renderer this module replaced, so dashboards and alerts keep
working (``tests/server/metrics_0.0.4.prom`` pins them).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine.scheduler import Scheduler
from .unknown_fields import UnknownFields

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
FINISH_REASONS = ("stop", "length", "cancelled", "error")
OPENMETRICS = "application/openmetrics-text"


class Metrics:
    def __init__(self, scheduler: Scheduler):
        self.registry = CollectorRegistry()
        self.requests = Counter("glm53_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                                registry=self.registry)
        self.ttft = Histogram("glm53_time_to_first_token_seconds", "Time from request to first generated token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.latency = Histogram("glm53_request_seconds", "Time from request to the end of its completion.",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.unknown_fields = UnknownFields(self.registry)
        self.registry.register(_EngineFigures(scheduler))
        ProcessCollector(registry=self.registry)  # process_*: CPU seconds, resident memory, open files, start time
        PlatformCollector(registry=self.registry)  # python_info
        GCCollector(registry=self.registry)  # python_gc_*

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def completed(self, seconds: float) -> None:
        self.latency.observe(seconds)

    def snapshot(self) -> dict:
        """The request figures of ``/stats``."""
        counts = {(s.labels["endpoint"], int(s.labels["status"])): int(s.value)
                  for s in _samples(self.requests) if s.name.endswith("_total")}
        ttft_sum, ttft_count = _sum_count(self.ttft)
        return {
            "requests": {f"{e} {s}": n for (e, s), n in sorted(counts.items())},
            "requests_total": sum(counts.values()),
            "ttft_seconds_mean": _mean(self.ttft),
            "request_seconds_mean": _mean(self.latency),
            # what a poller needs for the mean over its own intervals (the built-in page's TTFT chart)
            "ttft_seconds_sum": ttft_sum,
            "ttft_count": int(ttft_count),
        }

    def process(self) -> dict:
        """The process figures of ``/stats``, as the collectors of ``/metrics`` read them (None where the platform
        gives none)."""
        return {"rss_bytes": self.registry.get_sample_value("process_resident_memory_bytes")}

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """Every series, in the format that ``accept`` (a request's Accept header) prefers, and its content type."""
        encode, content_type = choose_encoder(accept or "")
        if content_type.startswith(OPENMETRICS):
            return encode(_OneFamilyPerName(self.registry)), content_type
        return encode(self.registry), content_type


class _EngineFigures:
    """The scheduler's counters and gauges and the backend's figures, read when the registry is collected."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        sched = self._scheduler
        s = sched.snapshot()
        yield GaugeMetricFamily("glm53_queue_depth", "Jobs waiting for a batch slot.", s["waiting"])
        yield GaugeMetricFamily("glm53_running_jobs", "Jobs being generated.", s["active"])
        yield GaugeMetricFamily("glm53_model_ready", "1 when the model is loaded.", int(s["state"] == "ready"))
        yield GaugeMetricFamily("glm53_decode_tokens_per_second", "Tokens per second over the recent engine steps (all jobs).",
                                s["decode_tokens_per_second"] or 0.0)
        yield CounterMetricFamily("glm53_prompt_tokens_total", "Prompt tokens admitted.", s["prompt_tokens"])
        yield CounterMetricFamily("glm53_completion_tokens_total", "Tokens generated.", s["completion_tokens"])
        yield CounterMetricFamily("glm53_prefix_cache_hit_tokens_total",
                                  "Prompt tokens served from the prefix cache (counted when a prefill completes).", s["prefix_cache_hits"])
        yield CounterMetricFamily("glm53_prefix_cache_miss_tokens_total", "Prompt tokens prefilled (counted when a prefill completes).",
                                  s["prefix_cache_misses"])
        yield GaugeMetricFamily("glm53_prefix_cache_hit_rate",
                                "Share of prefix-cache hit tokens among all prompt tokens counted so far (0 before any).",
                                s["prefix_cache_hit_rate"] or 0.0)
        yield CounterMetricFamily("glm53_engine_steps_total", "Engine forward steps.", s["steps"])
        yield CounterMetricFamily("glm53_engine_errors_total", "Engine steps that failed (every active job ended with an error).",
                                  s["engine_errors"])
        yield CounterMetricFamily("glm53_sequence_errors_total", "Jobs the engine failed alone (the rest of their batch went on).",
                                  s["sequence_errors"])
        finished = CounterMetricFamily("glm53_jobs_finished_total", "Jobs by how they ended.", labels=["reason"])
        for reason in FINISH_REASONS:
            finished.add_metric([reason], s["jobs_" + reason])
        yield finished
        yield CounterMetricFamily("glm53_jobs_rejected_total", "Requests refused with 429 (queue full).", s["jobs_rejected"])
        engine = sched.backend.stats() if s["state"] == "ready" else {}
        for name, value in _flatten(engine):
            yield GaugeMetricFamily(f"glm53_engine_{name}", "Backend figure (see /stats).", value)
        for name, series in _per_layer(engine):
            per_layer = GaugeMetricFamily(f"glm53_engine_{name}", "Backend figure per MoE layer (see /stats).", labels=["layer"])
            for layer, value in series:
                per_layer.add_metric([layer], value)
            yield per_layer


# the names a family takes beside its own, as CollectorRegistry counts them when it refuses duplicates
_SUFFIXES = {"counter": ("_total", "_created"), "summary": ("_sum", "_count", "_created"),
             "histogram": ("_bucket", "_sum", "_count", "_created"), "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
             "info": ("_info",)}


class _OneFamilyPerName:
    """A registry's families less any that takes a name an earlier one took. OpenMetrics names a counter's family
    without its ``_total``, so the backend's ``steps`` figure (the gauge ``glm53_engine_steps``) would clash with the
    scheduler's counter ``glm53_engine_steps_total``, which the Prometheus text format tells apart; the gauge is left
    out there (``/stats`` has it)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        taken: set[str] = set()
        for family in self._registry.collect():
            names = {family.name, *(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))}
            if names.isdisjoint(taken):
                taken |= names
                yield family


def _samples(metric) -> list:
    return [sample for family in metric.collect() for sample in family.samples]


def _sum_count(histogram: Histogram) -> tuple[float, float]:
    values = {s.name.rsplit("_", 1)[1]: s.value for s in _samples(histogram) if s.name.endswith(("_sum", "_count"))}
    return values["sum"], values["count"]


def _mean(histogram: Histogram) -> float | None:
    total, count = _sum_count(histogram)
    return total / count if count else None


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
