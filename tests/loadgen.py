"""Load against a server on loopback, for the load, soak and fault tests: timed streaming and plain requests,
many clients at once, Prometheus text parsing, and the gunicorn worker's resident memory.

Standard library only. Every request has a timeout: a hung request is a failure, never a stuck test.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Result:
    status: int = 0
    sent: float = 0.0  # time.monotonic() when the request went out
    first_token: float | None = None  # when the first generated text arrived
    done: float = 0.0
    chunks: int = 0  # SSE data frames with generated text
    completion_tokens: int | None = None  # from the usage block
    finish: str | None = None
    saw_done: bool = False  # the stream ended with data: [DONE]
    error: str | None = None  # transport failure, timeout, or an error event in the stream
    headers: dict[str, str] = field(default_factory=dict)
    body: object = None  # the parsed body of a non-streamed answer


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 60.0,
            stop_after_chunks: int | None = None, hang_up_on: Callable[[dict], bool] | None = None) -> Result:
    """One request. A streamed answer (``text/event-stream``) is read frame by frame; the client hangs up (goes
    away) after ``stop_after_chunks`` text frames, or at the first frame for which ``hang_up_on`` is true."""
    res = Result(sent=time.monotonic())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        res.status = resp.status
        res.headers = {k.lower(): v for k, v in resp.getheaders()}
        if res.headers.get("content-type", "").startswith("text/event-stream"):
            _read_stream(conn, resp, res, stop_after_chunks, hang_up_on)
        else:
            raw = resp.read()
            try:
                res.body = json.loads(raw)
            except ValueError:
                res.body = raw.decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.done = time.monotonic()
        conn.close()
    return res


def _read_stream(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, res: Result, stop_after_chunks: int | None,
                 hang_up_on: Callable[[dict], bool] | None) -> None:
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            res.saw_done = True
            return
        frame = json.loads(line[6:])
        if "error" in frame:
            res.error = frame["error"]["message"]
            continue
        if frame.get("usage"):
            res.completion_tokens = frame["usage"]["completion_tokens"]
        for choice in frame.get("choices") or []:
            delta = choice.get("delta", {})
            if choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                res.chunks += 1
                if res.first_token is None:
                    res.first_token = time.monotonic()
            if choice.get("finish_reason"):
                res.finish = choice["finish_reason"]
        if (stop_after_chunks is not None and res.chunks >= stop_after_chunks) or (hang_up_on is not None and hang_up_on(frame)):
            hang_up(conn, resp)
            return


def hang_up(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse | None = None) -> None:
    """Close abruptly (a plain close() waits for the response's file object to let go)."""
    try:
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    if resp is not None:
        resp.close()
    conn.close()


def concurrently(calls: Sequence[Callable[[], object]], start_gap_s: float = 0.0, timeout: float = 300.0) -> list:
    """Run each call on its own thread (the i-th starts i * start_gap_s after the first); their results, in order.

    :raise AssertionError: a call still running after ``timeout``.
    """
    results: list = [None] * len(calls)
    t0 = time.monotonic()

    def run(i: int) -> None:
        delay = t0 + i * start_gap_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    assert not stuck, f"{stuck} of {len(calls)} clients still running after {timeout} s"
    return results


def metrics(port: int) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value}."""
    res = request(port, "GET", "/metrics")
    assert res.status == 200, res
    out = {}
    for line in str(res.body).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def worker_pid(master_pid: int) -> int:
    """The gunicorn worker: the one child of the arbiter."""
    children = Path(f"/proc/{master_pid}/task/{master_pid}/children")
    if children.exists():
        pids = children.read_text().split()
    else:
        pids = [p for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == master_pid]
    assert len(pids) == 1, f"expected one worker under {master_pid}, found {pids}"
    return int(pids[0])


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
