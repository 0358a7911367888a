"""End-to-end tests shared by every engine: real gunicorn + gevent, the real `glm53 serve` command, the official
openai client. A test module imports them and provides the fixtures ``server`` (a started ``Server``) and
``concurrency`` (how many jobs the engine decodes at once)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from .servers import openai_client


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def stats(server) -> dict:
    return server.get("/stats")[1]["scheduler"]


def test_chat_and_completion(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=[{"role": "user", "content": "Hello"}], max_tokens=32, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and r.usage.completion_tokens <= 32
    assert r.usage.prompt_tokens > 5
    r = client.completions.create(model="glm-5.3-flash", prompt="Once upon", max_tokens=16, temperature=0)
    assert r.usage.completion_tokens <= 16 and isinstance(r.choices[0].text, str)


def test_seed_and_greedy_are_reproducible(client):
    def run(**kw):
        r = client.chat.completions.create(model="glm-5.3-flash", messages=[{"role": "user", "content": "seed test"}], max_tokens=40, **kw)
        return (r.choices[0].message.reasoning_content, r.choices[0].message.content)

    assert run(seed=7, temperature=1.0) == run(seed=7, temperature=1.0)
    assert run(temperature=0) == run(temperature=0)


def test_chat_logprobs_of_a_greedy_answer(client):
    """Greedy decoding picks the most likely token, so each token is its position's first top_logprobs entry; the
    stream carries the same entries as the answer."""
    kw = {"model": "glm-5.3-flash", "messages": [{"role": "user", "content": "logprobs"}], "max_tokens": 12, "temperature": 0,
          "logprobs": True, "top_logprobs": 3}
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and (e.top_logprobs[0].token, e.top_logprobs[0].bytes) == (e.token, e.bytes)
        assert e.logprob == e.top_logprobs[0].logprob <= 0 and e.logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices if c.logprobs
                for e in c.logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)


def test_concurrent_streams_interleave(server, client, concurrency):
    n, tokens = concurrency, 120
    arrivals: dict[int, list[float]] = {}
    usage: dict[int, int] = {}

    def one(i: int) -> None:
        times = []
        stream = client.chat.completions.create(
            model="glm-5.3-flash", messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, seed=i,
        )
        for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or getattr(chunk.choices[0].delta, "reasoning_content", None)):
                times.append(time.monotonic())
            if chunk.usage:
                usage[i] = chunk.usage.completion_tokens
        arrivals[i] = times

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(usage) == list(range(n)) and set(usage.values()) == {tokens}
    firsts = [a[0] for a in arrivals.values()]
    lasts = [a[-1] for a in arrivals.values()]
    assert max(firsts) < min(lasts), "some stream only started after another had finished: not interleaved"
    assert all(len(a) >= tokens // 4 for a in arrivals.values()), "text arrived in bursts instead of per token"
    assert stats(server)["active"] == 0


def _open_stream(server, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    assert resp.getheader("Cache-Control") == "no-cache" and resp.getheader("X-Accel-Buffering") == "no"
    return conn, resp


def _hang_up(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)  # a plain close() waits for the response's file object to let go
    resp.close()
    conn.close()


LONG = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 100000, "ignore_eos": True, "stream": True}


def _wait_for(predicate, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_disconnect_during_decode_cancels_the_job_promptly(server):
    before = stats(server)["jobs_cancelled"]
    conn, resp = _open_stream(server, LONG)
    for _ in range(5):
        resp.fp.readline()
    _hang_up(conn, resp)
    took = _wait_for(lambda: stats(server)["active"] == 0 and stats(server)["jobs_cancelled"] == before + 1, 5)
    assert took < 1.0, f"slot freed only after {took:.2f} s"


def test_queued_stream_gets_keepalives_and_disconnect_while_queued_cancels(server, concurrency):
    blockers = [_open_stream(server, LONG) for _ in range(concurrency)]  # fill every batch slot
    conn, resp = _open_stream(server, LONG)
    seen = [resp.fp.readline() for _ in range(6)]
    assert b": keep-alive\n" in seen, seen
    assert stats(server)["waiting"] == 1
    before = stats(server)["jobs_cancelled"]
    _hang_up(conn, resp)
    _wait_for(lambda: stats(server)["waiting"] == 0 and stats(server)["jobs_cancelled"] == before + 1, 2)
    for c, r in blockers:
        _hang_up(c, r)
    _wait_for(lambda: stats(server)["active"] == 0, 5)
