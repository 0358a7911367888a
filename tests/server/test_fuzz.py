"""Schema-driven fuzz of every endpoint, over real gunicorn + gevent with the scripted model.

The bodies come from the server's own ``/openapi.json`` (``schema_fuzz``): valid ones reach the handlers, mutated
ones the validators. Each endpoint gets a fixed number of cases, the same ones every run (derandomised). Every
answer must be below 500 and arrive within REQUEST_TIMEOUT_S, and afterwards the server must still answer a
normal request, hold no job, and have counted no 5xx in ``/metrics``.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from .schema_fuzz import SchemaStrategies, near_valid
from .servers import Server

CASES = {"POST": 300, "GET": 25}
REQUEST_TIMEOUT_S = 20
ENDPOINTS = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/generate"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", "/v1/models/{model_id}"), ("GET", "/v1/models"), ("GET", "/health"),
    ("GET", "/stats"), ("GET", "/server_info"), ("GET", "/metrics"), ("GET", "/openapi.json"),
]
URL_TEXT = st.text(st.characters(codec="utf-8"), max_size=16)
# What the model validators of server/protocol.py require beyond the schema; half the bodies follow these.
HINTS = {
    "ChatMessage": {"required": ["role", "content"]},
    "ContentPart": {"properties": {"type": {"const": "text"}, "text": {"type": "string"}}, "required": ["type", "text"]},
    "ResponseFormat": {"properties": {"type": {"const": "text"}}},
}
statuses: dict[str, Counter] = {}


@pytest.fixture(scope="module")
def server():
    # a short context bounds what a valid body can ask for (n=16 streams to the end of the context)
    s = Server(["--max-batch-size", "4", "-cs", "512", "--max-request-mb", "1"], module="tests.server.scripted_server").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def doc(server):
    code, body = server.get("/openapi.json")
    assert code == 200
    return body


def send(server: Server, method: str, target: str, body: bytes | None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request(method, target, body=body, headers={"Content-Type": "application/json"} if body is not None else {})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except socket.timeout:
        raise AssertionError(f"{method} {target} hung for over {REQUEST_TIMEOUT_S} s; body {body[:300] if body else None!r}") from None
    finally:
        conn.close()


def test_every_endpoint_is_described_and_fuzzed(doc):
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert described == set(ENDPOINTS)
    assert doc["openapi"] == "3.1.0"
    for path, ops in doc["paths"].items():
        if "post" in ops:
            ref = ops["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"], path


def _cases(doc: dict, method: str, path: str):
    """A strategy of (request target, body) for one operation."""
    op = doc["paths"][path][method.lower()]
    plain, hinted = (SchemaStrategies(doc["components"]["schemas"], hints=h) for h in (None, HINTS))
    if method == "POST":
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        body = st.one_of(near_valid(plain, schema), near_valid(hinted, schema)).map(lambda v: json.dumps(v).encode())
        return st.tuples(st.just(path), body)
    if op.get("parameters"):
        # arbitrary bytes, percent-encoded: invalid UTF-8 in the path is part of the fuzz
        segment = st.binary(max_size=24).map(lambda b: urllib.parse.quote_from_bytes(b, safe=""))
        return st.tuples(segment.map(lambda seg: path.replace("{model_id}", seg)), st.none())
    query = st.dictionaries(URL_TEXT, URL_TEXT, max_size=3).map(urllib.parse.urlencode)
    return st.tuples(query.map(lambda q: f"{path}?{q}" if q else path), st.none())


@pytest.mark.parametrize("method,path", ENDPOINTS)
def test_fuzz_endpoint(server, doc, method, path):
    seen = statuses.setdefault(f"{method} {path}", Counter())

    @settings(max_examples=CASES[method], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(_cases(doc, method, path))
    def case(request):
        target, body = request
        status = send(server, method, target, body)
        seen[status] += 1
        assert status < 500, f"{method} {target} answered {status} to {body[:500] if body else None!r}"

    case()
    assert sum(seen.values()) >= CASES[method] // 2  # hypothesis stops early only when it runs out of distinct cases


def test_server_still_serves_and_holds_nothing_after_the_fuzz(server):
    code, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "[[script:plain]]"}],
                                                      "chat_template_kwargs": {"enable_thinking": False}})
    assert code == 200 and body["choices"][0]["message"]["content"] == "Hello there, friend."
    sched = server.get("/stats")[1]["scheduler"]
    assert (sched["in_system"], sched["active"], sched["waiting"]) == (0, 0, 0)
    text = server.get("/metrics")[1]
    # /health answers 503 while the model loads (wait_ready polls it); any other 5xx is a failure
    server_errors = [line for line in text.splitlines()
                     if line.startswith("glm53_requests_total") and 'status="5' in line and 'endpoint="/health"' not in line]
    assert server_errors == []
    total = sum(sum(c.values()) for c in statuses.values())
    print(f"\nfuzzed {total} requests over {len(statuses)} endpoints:")
    for endpoint, counter in sorted(statuses.items()):
        print(f"  {endpoint}: {dict(sorted(counter.items()))}")
