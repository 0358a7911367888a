"""Schema-driven fuzz of every endpoint, over real gunicorn + gevent with the scripted model.

The bodies come from the server's own ``/openapi.json`` (``schema_fuzz``): valid ones reach the handlers, mutated
ones the validators. Each endpoint gets a fixed number of cases, the same ones every run (derandomised). Every
answer must be below 500 and arrive within REQUEST_TIMEOUT_S, and afterwards the server must still answer a
normal request, hold no job, and have counted no 5xx in ``/metrics``.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from . import apps
from .schema_fuzz import ENDPOINTS, FUZZ_BUDGET, GPU_CORPUS, GPU_CORPUS_CASES, bounded, operation_cases, send
from .servers import Server

CASES = {"POST": 300, "GET": 25}
# the endpoints that generate tokens
GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/generate")
REQUEST_TIMEOUT_S = 20
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


def test_every_endpoint_is_described_and_fuzzed(doc):
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert described == set(ENDPOINTS)
    assert doc["openapi"] == "3.1.0"
    for path, ops in doc["paths"].items():
        if "post" in ops:
            ref = ops["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"], path


def test_the_gpu_fuzz_corpus_covers_every_operation():
    """tests/gpu replays a stored corpus (no hypothesis there); rewrite it with ``python -m tests.server.schema_fuzz``."""
    cases = json.loads(GPU_CORPUS.read_text())["cases"]
    counts = Counter(c["operation"] for c in cases)
    assert set(counts) == {f"{m} {p}" for m, p in ENDPOINTS}
    assert all(n >= GPU_CORPUS_CASES.get(op, GPU_CORPUS_CASES[op.split()[0]]) // 2 for op, n in counts.items()), counts
    for c in cases:
        assert (c["body"] is None) == c["operation"].startswith("GET ") and c["target"].startswith("/")
        if c["body"] is not None:
            json.loads(c["body"])  # bodies are JSON text (lone surrogates as \ud800 escapes)


@pytest.mark.parametrize("method,path", ENDPOINTS)
def test_fuzz_endpoint(server, doc, method, path):
    seen = statuses.setdefault(f"{method} {path}", Counter())

    @settings(max_examples=CASES[method], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(operation_cases(doc, method, path))
    def case(request):
        target, body = request
        status, _ = send(server.port, method, target, body, REQUEST_TIMEOUT_S)
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


def _completion_tokens(client) -> float:
    text = client.get("/metrics").get_data(as_text=True)
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("glm53_completion_tokens_total"))


def _choices(body: bytes | None) -> int:
    value = json.loads(body) if body else None
    if not isinstance(value, dict):
        return 1
    counts = [value.get(k) for k in ("n", "best_of")]
    return max([1] + [c for c in counts if isinstance(c, int) and not isinstance(c, bool)])


def test_the_gpu_replay_bounds_every_case_of_its_corpus():
    """tests/gpu replays its corpus on a long context, where a case without a budget generates to the context's end
    (a POST /v1/responses without max_output_tokens once ran past the replay's 60 s timeout there). Replayed here as
    bounded() sends it, on the demo model with the GPU run's context, no case generates more than FUZZ_BUDGET tokens
    a choice."""
    cases = json.loads(GPU_CORPUS.read_text())["cases"]
    generating = [c for c in cases if c["operation"] in {f"POST {p}" for p in GENERATING}]
    assert {c["operation"] for c in generating} == {f"POST {p}" for p in GENERATING}
    with apps.tiny(["-cs", "32768", "--max-batch-size", "8"]) as app:
        client = app.test_client()
        for case in generating:
            path = case["operation"].split(" ", 1)[1]
            body = bounded(path, case["body"])
            before = _completion_tokens(client)
            client.post(case["target"], data=body, content_type="application/json")
            made = _completion_tokens(client) - before
            assert made <= FUZZ_BUDGET * _choices(body), (case["target"], made, body[:300])
