"""Unknown top-level request fields are served, logged once per endpoint and field, and counted in /metrics
(with the Flask test client over the app and a scripted backend: no server process needed)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from glm53 import config
from glm53.server import unknown_fields
from tests.fakes import ScriptedBackend

from . import apps


@pytest.fixture
def client():
    with apps.running(config.load([], {}), ScriptedBackend) as app:
        yield app.test_client()


def ignored_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]


def ignored_counts(client) -> dict[str, float]:
    text = client.get("/metrics").get_data(as_text=True)
    return {s.labels["endpoint"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "glm53_ignored_request_fields_total"}


def test_each_endpoint_and_field_is_logged_once_and_every_occurrence_counted(client, caplog):
    caplog.set_level(logging.INFO, logger="glm53.server")
    for _ in range(3):
        assert client.post("/tokenize", json={"text": "a", "frobnicate": 1, "tenant": "x"}).status_code == 200
    assert client.post("/detokenize", json={"tokens": [65], "frobnicate": 2}).status_code == 200
    assert client.post("/tokenize", json={"text": "a"}).status_code == 200
    assert sorted(ignored_lines(caplog)) == [
        "ignoring unknown request field 'frobnicate' on /detokenize (logged once; counted in glm53_ignored_request_fields_total)",
        "ignoring unknown request field 'frobnicate' on /tokenize (logged once; counted in glm53_ignored_request_fields_total)",
        "ignoring unknown request field 'tenant' on /tokenize (logged once; counted in glm53_ignored_request_fields_total)",
    ]
    assert ignored_counts(client) == {"/detokenize": 1, "/tokenize": 6}


def test_a_client_inventing_names_cannot_grow_the_log_or_the_memory(client, caplog, monkeypatch):
    monkeypatch.setattr(unknown_fields, "MAX_LOGGED", 3)
    caplog.set_level(logging.INFO, logger="glm53.server")
    for i in range(10):
        assert client.post("/tokenize", json={"text": "a", f"field{i}": i}).status_code == 200
    lines = ignored_lines(caplog)
    assert len(lines) == 4 and lines[-1] == ("more than 3 distinct unknown request fields: the others are counted in "
                                             "glm53_ignored_request_fields_total, not logged")
    assert ignored_counts(client) == {"/tokenize": 10}
