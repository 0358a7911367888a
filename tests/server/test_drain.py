"""SIGTERM over real gunicorn + gevent with the scripted model (10 ms per engine step): in-flight streams finish
within the grace period while new requests get 503 with Retry-After (the listener keeps answering), /health says
draining, and streams that outlast the grace period end with an error event and [DONE], never a cut.
"""

from __future__ import annotations

import signal
import threading
import time

from tests import loadgen

from .servers import Server

STEP_S = 0.01


def start(grace_s: float) -> Server:
    return Server(["--max-batch-size", "4", "-cs", "4096", "--shutdown-grace-s", str(grace_s)], env={"SCRIPTED_STEP_S": str(STEP_S)},
                  module="tests.server.scripted_server").wait_ready()


def long_stream(tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": "[[script:long]]"}], "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}


def in_background(port: int, body: dict, n: int) -> tuple[list, list[threading.Thread]]:
    results: list = [None] * n

    def run(i):
        results[i] = loadgen.request(port, "POST", "/v1/chat/completions", body, timeout=60)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return results, threads


def wait_active(server: Server, n: int) -> None:
    deadline = time.monotonic() + 5
    while server.get("/stats")[1]["scheduler"]["active"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_sigterm_lets_in_flight_streams_finish_and_refuses_new_requests_with_503():
    server = start(grace_s=20)
    try:
        tokens = 150  # 1.5 s of decoding each
        results, threads = in_background(server.port, long_stream(tokens), 3)
        wait_active(server, 3)
        t_term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        health = loadgen.request(server.port, "GET", "/health")
        while health.status == 200 and time.monotonic() - t_term < 2:
            health = loadgen.request(server.port, "GET", "/health")
        assert (health.status, health.body) == (503, {"status": "draining"})
        refused = loadgen.request(server.port, "POST", "/v1/completions", {"prompt": "[[script:plain]]"})
        assert refused.error is None, "the listener must keep answering during the drain"
        assert refused.status == 503 and refused.headers["retry-after"] == "5" and refused.body["error"]["code"] == "shutting_down"
        assert refused.headers.get("connection") == "close"
        for t in threads:
            t.join(30)
        streams_done = max(r.done for r in results) - t_term
        for r in results:
            assert (r.status, r.error, r.finish, r.completion_tokens, r.saw_done) == (200, None, "length", tokens, True)
        server.proc.wait(20)
        exited = time.monotonic() - t_term
        assert server.proc.returncode == 0
        print(f"\ndrain: 3 in-flight streams finished {streams_done:.2f} s after SIGTERM; the server exited after {exited:.2f} s (grace 20 s)")
        assert exited < 20
        log = server.log()
        assert "draining 3 request(s) in flight" in log and "drained in" in log
    finally:
        server.stop()


def test_streams_that_outlast_the_grace_period_end_with_an_error_event_and_done():
    grace = 1.0
    server = start(grace_s=grace)
    try:
        results, threads = in_background(server.port, long_stream(2000), 2)  # 20 s of decoding each
        wait_active(server, 2)
        t_term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        for r in results:
            assert r.status == 200 and r.saw_done and r.finish is None and "server shutting down" in r.error
        ended = max(r.done for r in results) - t_term
        server.proc.wait(20)
        exited = time.monotonic() - t_term
        print(f"\ndrain past the grace period ({grace} s): streams ended with an error event after {ended:.2f} s; exit after {exited:.2f} s")
        assert grace <= ended < grace + 2.5 and exited < grace + 4
        assert "grace period over with 2 request(s) in flight: cancelling them" in server.log()
    finally:
        server.stop()
