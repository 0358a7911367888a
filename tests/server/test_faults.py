"""Faults over real gunicorn + gevent with the scripted model (20 ms per engine step, 2 batch slots): a client
that goes away in every phase of its job frees its slot, and an engine failure of one sequence ends that job
alone. (SIGTERM draining is in ``test_drain.py``.)
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests import loadgen

from .servers import Server

STEP_S = 0.02
LONG = {"messages": [{"role": "user", "content": "[[script:long]]"}], "max_tokens": 2000, "stream": True}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def server():
    s = Server(["--max-batch-size", "2", "-cs", "4096"], env={"SCRIPTED_STEP_S": str(STEP_S)}, module="tests.server.scripted_server").wait_ready()
    yield s
    s.stop()


def stats(server: Server) -> dict:
    return server.get("/stats")[1]


def wait_for(predicate, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - t0


def open_stream(server: Server, body: dict):
    """A started stream: the connection and its response, whose first chunk (the role) has been sent."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def idle(server: Server) -> bool:
    s = stats(server)
    return s["scheduler"]["in_system"] == 0 and s["engine"]["active_sequences"] == 0


def assert_slot_freed(server: Server, cancelled_before: int) -> float:
    """Seconds until the job was cancelled and the engine holds no sequence; then a new request is served."""
    took = wait_for(lambda: idle(server) and stats(server)["scheduler"]["jobs_cancelled"] == cancelled_before + 1)
    res = loadgen.request(server.port, "POST", "/v1/completions", {"prompt": "[[script:plain]]"})
    assert res.status == 200 and res.body["choices"][0]["text"] == "Hello there, friend."
    return took


def test_disconnect_while_queued(server):
    holders = [open_stream(server, LONG) for _ in range(2)]
    wait_for(lambda: stats(server)["scheduler"]["active"] == 2)
    conn, resp = open_stream(server, LONG)
    wait_for(lambda: stats(server)["scheduler"]["waiting"] == 1)
    before = stats(server)["scheduler"]["jobs_cancelled"]
    added_before = stats(server)["scheduler"]["prompt_tokens"]
    loadgen.hang_up(conn, resp)
    wait_for(lambda: stats(server)["scheduler"]["waiting"] == 0 and stats(server)["scheduler"]["jobs_cancelled"] == before + 1)
    assert stats(server)["scheduler"]["prompt_tokens"] == added_before  # it never reached the engine
    for c, r in holders:
        loadgen.hang_up(c, r)
    wait_for(lambda: idle(server))


def test_disconnect_during_prefill(server):
    conn, resp = open_stream(server, {**LONG, "messages": [{"role": "user", "content": "[[script:slow_prefill]]"}]})
    wait_for(lambda: stats(server)["engine"]["prefilling"] == 1)
    before = stats(server)["scheduler"]["jobs_cancelled"]
    loadgen.hang_up(conn, resp)
    took = assert_slot_freed(server, before)
    assert took < 1.0 and stats(server)["engine"]["prefilling"] == 0


def test_disconnect_during_decode(server):
    before = stats(server)["scheduler"]["jobs_cancelled"]
    res = loadgen.request(server.port, "POST", "/v1/chat/completions", LONG, stop_after_chunks=5)
    assert res.chunks == 5 and res.finish is None
    assert assert_slot_freed(server, before) < 1.0


def test_disconnect_mid_tool_call(server):
    body = {"messages": [{"role": "user", "content": "[[script:weather]]"}], "tools": TOOLS, "stream": True}
    before = stats(server)["scheduler"]["jobs_cancelled"]

    def inside_the_call(frame: dict) -> bool:
        calls = [tc for c in frame.get("choices") or [] for tc in (c.get("delta", {}).get("tool_calls") or [])]
        return any(tc.get("function", {}).get("arguments") for tc in calls)  # the name is out, arguments flowing

    res = loadgen.request(server.port, "POST", "/v1/chat/completions", body, hang_up_on=inside_the_call)
    assert res.finish is None and not res.saw_done
    assert assert_slot_freed(server, before) < 1.0


def test_disconnect_while_waiting_for_a_non_streamed_answer(server):
    before = stats(server)["scheduler"]["jobs_cancelled"]
    body = json.dumps({**LONG, "stream": False}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: stats(server)["scheduler"]["active"] == 1)
    sock.close()
    assert assert_slot_freed(server, before) < 1.0


def test_an_engine_failure_of_one_sequence_ends_only_that_job(server):
    before = loadgen.metrics(server.port)
    plain = {"messages": [{"role": "user", "content": "[[script:unicode]]"}], "stream": True, "chat_template_kwargs": {"enable_thinking": False}}
    failing = {"messages": [{"role": "user", "content": "[[script:fail_alone]]"}], "stream": True, "chat_template_kwargs": {"enable_thinking": False}}
    ok, bad = loadgen.concurrently([lambda: loadgen.request(server.port, "POST", "/v1/chat/completions", plain),
                                    lambda: loadgen.request(server.port, "POST", "/v1/chat/completions", failing)])
    assert ok.error is None and ok.finish == "stop" and ok.saw_done
    assert bad.error and "injected failure of sequence" in bad.error and bad.saw_done and bad.finish is None
    code, resp = server.post("/v1/chat/completions", {**failing, "stream": False})
    assert code == 500 and resp["error"]["code"] == "engine_error" and "injected failure of sequence" in resp["error"]["message"]
    after = loadgen.metrics(server.port)
    assert after["glm53_sequence_errors_total"] - before["glm53_sequence_errors_total"] == 2
    assert after["glm53_engine_errors_total"] == before["glm53_engine_errors_total"]
    assert idle(server)


def requests_by_status(server: Server, path: str) -> dict[str, float]:
    prefix = f'glm53_requests_total{{endpoint="{path}",status="'
    return {k[len(prefix):-2]: v for k, v in loadgen.metrics(server.port).items() if k.startswith(prefix)}


def access_statuses(server: Server, path: str) -> list[str]:
    return [line.split(f" {path} ")[1].split()[0] for line in server.log().splitlines() if "glm53.access:" in line and f" {path} " in line]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_client_that_hangs_up_is_counted_as_499_not_as_a_server_error(server, streamed):
    path = "/v1/chat/completions"
    before, logged_before = requests_by_status(server, path), len(access_statuses(server, path))
    if streamed:
        res = loadgen.request(server.port, "POST", path, LONG, stop_after_chunks=5)
        assert res.chunks == 5 and res.finish is None
    else:
        body = json.dumps({**LONG, "stream": False}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (path.encode(), len(body), body))
        wait_for(lambda: stats(server)["scheduler"]["active"] == 1)
        sock.close()
    wait_for(lambda: len(access_statuses(server, path)) == logged_before + 1)  # logged once its response is closed
    after = requests_by_status(server, path)
    assert access_statuses(server, path)[-1] == "499"
    assert {s: n - before.get(s, 0) for s, n in after.items() if n != before.get(s, 0)} == {"499": 1}
