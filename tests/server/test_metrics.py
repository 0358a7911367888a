"""``/metrics`` through prometheus_client: the series of the hand-written renderer it replaced (names, labels, types,
help texts: ``metrics_0.0.4.prom``), the exposition format chosen by ``Accept``, the process figures, and one
registry per app. The e2e suites scrape real servers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from glm53.server.metrics import Metrics, _flatten, _per_layer

from . import apps

GOLDEN = Path(__file__).with_name("metrics_0.0.4.prom")
SCHEDULER = {"waiting": 1, "active": 2, "state": "ready", "decode_tokens_per_second": 12.5, "prompt_tokens": 100,
             "completion_tokens": 50, "prefix_cache_hits": 30, "prefix_cache_misses": 70, "prefix_cache_hit_rate": 0.3, "steps": 9,
             "engine_errors": 1, "sequence_errors": 2, "jobs_stop": 3, "jobs_length": 4, "jobs_cancelled": 5, "jobs_error": 6,
             "jobs_rejected": 7}
ENGINE = {"steps": 9, "active_sequences": 2, "flag": True,
          "offload": {"cache": {"hit_rate": 0.4, "per_layer": [{"layer": "model.layers.3.mlp", "slots": 2, "hits": 5}]}}}
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
# what Prometheus 3 sends when it scrapes (its default scrape_protocols)
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;"
                     "version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")


def test_per_layer_figures_become_one_labelled_series_per_field():
    engine = {"steps": 3, "offload": {"cache": {"hit_rate": 0.4, "per_layer": [
        {"layer": "model.layers.3.mlp", "slots": 2, "hits": 5, "hit_rate": 0.25},
        {"layer": "model.layers.4.mlp", "slots": 30, "hits": 0, "hit_rate": None},
    ]}}}
    assert dict(_flatten(engine)) == {"steps": 3, "offload_cache_hit_rate": 0.4}  # lists are not flattened
    assert dict(_per_layer(engine)) == {
        "offload_cache_per_layer_slots": [("model.layers.3.mlp", 2), ("model.layers.4.mlp", 30)],
        "offload_cache_per_layer_hits": [("model.layers.3.mlp", 5), ("model.layers.4.mlp", 0)],
        "offload_cache_per_layer_hit_rate": [("model.layers.3.mlp", 0.25)],  # a layer without picks has no rate
    }
    assert list(_per_layer({"plain": [1, 2], "other": [{"name": "x", "v": 1}]})) == []


@pytest.fixture
def metrics() -> Metrics:
    """The state the golden file was rendered from."""
    scheduler = SimpleNamespace(snapshot=lambda: SCHEDULER, state="ready", backend=SimpleNamespace(stats=lambda: ENGINE))
    m = Metrics(scheduler)
    for endpoint, status in (("/v1/chat/completions", 200), ("/v1/chat/completions", 499), ("/health", 503)):
        m.request_done(endpoint, status)
    m.first_token(0.03)
    m.completed(1.2)
    m.unknown_fields.note("/tokenize", ["x", "y"])
    return m


def families(parsed) -> dict[tuple[str, str], tuple[str, set]]:
    """(name, type) -> (help, {(sample name, labels, value)}) of the glm53 families (by type too: the text format has a
    gauge glm53_engine_steps beside the counter glm53_engine_steps_total, whose family is glm53_engine_steps)."""
    return {(f.name, f.type): (f.documentation, {(s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples})
            for f in parsed if f.name.startswith("glm53_")}


def without_created(fams: dict) -> dict:
    """The families less the ``_created`` series prometheus_client adds to its counters and histograms (the text
    format writes them as gauges of their own, OpenMetrics as samples of their family)."""
    return {key: (doc, {s for s in samples if not s[0].endswith("_created")})
            for key, (doc, samples) in fams.items() if not key[0].endswith("_created")}


def test_the_text_format_has_every_series_of_the_hand_written_renderer_and_no_other(metrics):
    body, content_type = metrics.exposition(None)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    served = families(parse_text(body.decode()))
    assert without_created(served) == families(parse_text(GOLDEN.read_text()))
    assert {name for name, _ in served if name.endswith("_created")} == {
        "glm53_requests_created", "glm53_time_to_first_token_seconds_created", "glm53_request_seconds_created",
        "glm53_ignored_request_fields_created"}


def test_openmetrics_has_the_same_series_less_the_engine_figure_whose_name_clashes(metrics):
    body, content_type = metrics.exposition(OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0; charset=utf-8")
    text = body.decode()
    assert text.endswith("# EOF\n")
    served = without_created(families(parse_openmetrics(text)))  # the strict parser: one family per name, # EOF
    golden = families(parse_text(GOLDEN.read_text()))
    # the backend's `steps` figure, the gauge glm53_engine_steps, would take the name of the family of the counter
    # glm53_engine_steps_total: the counter stays
    del golden[("glm53_engine_steps", "gauge")]
    assert served == golden


@pytest.fixture
def client():
    with apps.scripted(["-cs", "4096"]) as app:
        yield app.test_client()


@pytest.mark.parametrize("accept,content_type", [
    (None, "text/plain; version=0.0.4; charset=utf-8"),
    ("text/plain", "text/plain; version=0.0.4; charset=utf-8"),
    ("*/*", "text/plain; version=0.0.4; charset=utf-8"),
    ("text/plain; version=1.0.0", "text/plain; version=1.0.0; charset=utf-8; escaping=underscores"),
    (OPENMETRICS, "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"),
    ("application/openmetrics-text", "application/openmetrics-text; version=1.0.0; charset=utf-8"),
    (PROMETHEUS_ACCEPT, "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=allow-utf-8"),
])
def test_the_exposition_format_follows_the_accept_header(client, accept, content_type):
    assert client.post("/tokenize", json={"text": "a"}).status_code == 200
    r = client.get("/metrics", headers={"Accept": accept} if accept else {})
    assert (r.status_code, r.headers["Content-Type"]) == (200, content_type)
    parse = parse_openmetrics if content_type.startswith("application/openmetrics-text") else parse_text
    served = {s.name: s for f in parse(r.get_data(as_text=True)) for s in f.samples}
    assert served["glm53_model_ready"].value == 1
    assert any(s.name == "glm53_requests_total" and s.labels == {"endpoint": "/tokenize", "status": "200"} and s.value == 1
               for f in parse(r.get_data(as_text=True)) for s in f.samples)


def test_process_and_python_figures_are_served(client):
    text = client.get("/metrics").get_data(as_text=True)
    samples = {s.name: s for f in parse_text(text) for s in f.samples}
    for name in ("process_resident_memory_bytes", "process_virtual_memory_bytes", "process_start_time_seconds",
                 "process_cpu_seconds_total", "process_open_fds"):
        assert samples[name].value > 0, name
    assert samples["python_info"].labels["implementation"] and "python_gc_collections_total" in samples


def counted(client) -> dict[tuple, float]:
    """The request and ignored-field counters of one scrape, by (name, labels)."""
    text = client.get("/metrics").get_data(as_text=True)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parse_text(text) for s in f.samples
            if s.name in ("glm53_requests_total", "glm53_ignored_request_fields_total")}


def test_each_app_counts_in_its_own_registry():
    with apps.scripted() as first, apps.scripted() as second:
        a, b = first.test_client(), second.test_client()
        for _ in range(3):
            assert a.post("/tokenize", json={"text": "a", "extra": 1}).status_code == 200
        assert b.get("/v1/models").status_code == 200
        assert counted(a) == {("glm53_requests_total", (("endpoint", "/tokenize"), ("status", "200"))): 3,
                              ("glm53_ignored_request_fields_total", (("endpoint", "/tokenize"),)): 3}
        assert counted(b) == {("glm53_requests_total", (("endpoint", "/v1/models"), ("status", "200"))): 1}
        assert a.get("/stats").get_json()["requests"] == {"requests": {"/metrics 200": 1, "/tokenize 200": 3}, "requests_total": 4,
                                                          "ttft_seconds_mean": None, "request_seconds_mean": None,
                                                          "ttft_seconds_sum": 0.0, "ttft_count": 0}
