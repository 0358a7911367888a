"""Load over real gunicorn + gevent: 64 streaming clients on 8 batch slots of the CPU demo model (all complete,
first come first served, all counted), and concurrency past the queue limit (429 with Retry-After at once).
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from functools import partial

import pytest

from tests import loadgen

from .servers import Server

CLIENTS = 64
SLOTS = 8
TOKENS = 48


@pytest.fixture(scope="module")
def recording():
    s = Server(["--max-batch-size", str(SLOTS), "-cs", "2048"], module="tests.server.recording_server").wait_ready()
    yield s
    s.stop()


def chat(i: int, tokens: int = TOKENS) -> dict:
    return {"messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": tokens, "ignore_eos": True, "seed": i,
            "stream": True, "stream_options": {"include_usage": True}}


def test_64_streaming_clients_on_8_slots_complete_first_come_first_served_and_are_counted(recording):
    port = recording.port
    before = loadgen.metrics(port)
    calls = [partial(loadgen.request, port, "POST", "/v1/chat/completions", chat(i), 120) for i in range(CLIENTS)]
    results = loadgen.concurrently(calls, start_gap_s=0.005)
    bad = [(i, r.status, r.error, r.finish) for i, r in enumerate(results)
           if (r.status, r.error, r.saw_done, r.finish, r.completion_tokens) != (200, None, True, "length", TOKENS)]
    assert not bad, bad

    # the scheduler admits in order of arrival: sequence ids (given at arrival) come out sorted
    admissions = [(seq, tag) for seq, tag in recording.get("/stats")[1]["engine"]["admissions"] if tag is not None]
    assert sorted(tag for _, tag in admissions) == list(range(CLIENTS))
    assert [seq for seq, _ in admissions] == sorted(seq for seq, _ in admissions)
    # and the clients see it: nobody's first token comes after that of a client who arrived two waves later
    by_arrival = [results[tag] for _, tag in admissions]
    late = [(k, j) for k in range(CLIENTS) for j in range(k + 2 * SLOTS, CLIENTS) if by_arrival[k].first_token > by_arrival[j].first_token]
    assert not late, late

    after = loadgen.metrics(port)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta['glm53_requests_total{endpoint="/v1/chat/completions",status="200"}'] == CLIENTS
    assert delta['glm53_jobs_finished_total{reason="length"}'] == CLIENTS
    assert delta["glm53_completion_tokens_total"] == CLIENTS * TOKENS
    assert recording.get("/stats")[1]["scheduler"]["in_system"] == 0
    ttft = sorted(r.first_token - r.sent for r in results)
    print(f"\n{CLIENTS} clients on {SLOTS} slots: time to first token p50 {statistics.median(ttft):.3f} s, "
          f"max {ttft[-1]:.3f} s; all done in {max(r.done for r in results) - min(r.sent for r in results):.2f} s")


@pytest.fixture(scope="module")
def small_queue():
    # 20 ms per engine step: a long stream holds its slot for the length of the test
    s = Server(["--max-batch-size", "2", "--max-queue", "4", "-cs", "4096"], env={"SCRIPTED_STEP_S": "0.02"},
               module="tests.server.scripted_server").wait_ready()
    yield s
    s.stop()


def test_over_the_queue_limit_gets_429_with_retry_after_never_a_timeout(small_queue):
    port = small_queue.port
    long = {"messages": [{"role": "user", "content": "[[script:long]]"}], "max_tokens": 2000, "stream": True}
    holders = []
    for _ in range(2 + 4):  # every slot and every queue place
        conn, resp = _open_stream(port, long)
        holders.append((conn, resp))
    deadline = time.monotonic() + 5  # the scheduler takes new jobs between steps
    while _queue_state(small_queue) != (2, 4) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _queue_state(small_queue) == (2, 4)
    before = loadgen.metrics(port)
    extra = 26
    results = loadgen.concurrently([partial(loadgen.request, port, "POST", "/v1/chat/completions", long, 10) for _ in range(extra)])
    assert [r.status for r in results] == [429] * extra, [(r.status, r.error) for r in results]
    assert all(r.headers.get("retry-after") == "1" and r.body["error"]["code"] == "server_busy" for r in results)
    slowest = max(r.done - r.sent for r in results)
    print(f"\n{extra} requests past a full queue (2 slots + 4 places): all 429 with Retry-After, the slowest in {slowest:.3f} s")
    assert slowest < 2.0, f"a refusal took {slowest:.2f} s"
    after = loadgen.metrics(port)
    assert after["glm53_jobs_rejected_total"] - before["glm53_jobs_rejected_total"] == extra
    counted = 'glm53_requests_total{endpoint="/v1/chat/completions",status="429"}'
    assert after[counted] - before.get(counted, 0) == extra
    for conn, resp in holders:
        loadgen.hang_up(conn, resp)
    deadline = time.monotonic() + 5
    while small_queue.get("/stats")[1]["scheduler"]["in_system"] and time.monotonic() < deadline:
        time.sleep(0.05)
    ok = loadgen.request(port, "POST", "/v1/completions", {"prompt": "[[script:plain]]"})
    assert ok.status == 200 and ok.body["choices"][0]["text"] == "Hello there, friend."


def _open_stream(port: int, body: dict):
    """A stream whose headers have arrived (a chat stream sends its first chunk even while queued)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _queue_state(server: Server) -> tuple[int, int]:
    sched = server.get("/stats")[1]["scheduler"]
    return sched["active"], sched["waiting"]
