"""HTTP plumbing shared by the bench tools: JSON requests, server-sent events, optional endpoints; and the
summary statistics they share.

Python standard library only, so the tools run on any machine with a Python 3.11 and nothing installed, against
any server that speaks the same endpoints (glm53, the original glm53-flash-offload server, SGLang).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

# GLM's chat format with thinking off: the prompt every decode measurement uses, written out so that it does
# not depend on the server's chat template.
THINKING_OFF = "[gMASK]<sop><|user|>{}<|assistant|><think></think>"


def chat_prompt(user_text: str) -> str:
    """The thinking-off GLM chat prompt for one user message (text, to be tokenised by the server)."""
    return THINKING_OFF.format(user_text)


class ServerError(RuntimeError):
    """The server answered with an HTTP error, or a stream carried an error event."""

    def __init__(self, where: str, detail: str, status: int | None = None):
        super().__init__(f"{where}: HTTP {status}: {detail}" if status else f"{where}: {detail}")
        self.status = status


class Client:
    def __init__(self, url: str, timeout: float = 600.0, api_key: str | None = None):
        """
        :param url: the server's base URL (``http://host:port``).
        :param timeout: seconds any one socket operation may wait.
        :param api_key: sent as ``Authorization: Bearer <key>`` when given.
        """
        self.base = url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _open(self, path: str, body: dict | None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{'POST' if body is not None else 'GET'} {path}", _error_text(e.read()), e.code) from None
        except urllib.error.URLError as e:
            raise ConnectionError(f"cannot reach {self.base + path}: {e.reason}") from None

    def get(self, path: str) -> dict:
        """:raise ServerError: an HTTP error status."""
        with self._open(path, None) as resp:
            return json.loads(resp.read())

    def get_optional(self, path: str) -> dict | None:
        """The JSON at ``path``, or None where the server does not offer it (an error status or a body that is
        not a JSON object); a note goes to stderr. Connection failures still raise: the server is gone."""
        try:
            body = self.get(path)
        except (ServerError, ValueError) as e:
            print(f"note: {path} not available ({e}); recorded as null", file=sys.stderr)
            return None
        return body if isinstance(body, dict) else None

    def post(self, path: str, body: dict) -> dict:
        """:raise ServerError: an HTTP error status."""
        with self._open(path, body) as resp:
            return json.loads(resp.read())

    def stream(self, path: str, body: dict) -> Iterator[tuple[float, dict]]:
        """POST ``body`` and yield ``(arrival time, event)`` for each SSE ``data:`` event until ``[DONE]`` or the
        end of the response. Arrival times are ``time.monotonic()`` taken as each line is read.

        :raise ServerError: an HTTP error status, or an event that carries ``error``.
        """
        with self._open(path, body) as resp:
            for raw in resp:
                arrived = time.monotonic()
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data:"):
                    continue  # blank separators and keep-alive comments
                payload = line[len("data:"):].lstrip(" ")
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if isinstance(event, dict) and event.get("error"):
                    raise ServerError(f"POST {path}", "error event: " + _error_text(json.dumps(event).encode()))
                yield arrived, event


def _error_text(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.decode("utf-8", "replace")[:500]
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)


def add_server_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="the server's base URL")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one socket operation may wait")


def client_from_args(args: argparse.Namespace) -> Client:
    return Client(args.url, args.timeout, args.api_key)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_json(result: dict, out: str | None) -> None:
    """Write ``result`` to ``out``, or print it when ``out`` is None."""
    text = json.dumps(result, indent=2) + "\n"
    if out is None:
        sys.stdout.write(text)
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def percentile(values, q: float) -> float:
    """Linear-interpolation percentile (numpy's default)."""
    ordered = sorted(values)
    x = (len(ordered) - 1) * q / 100
    lo = math.floor(x)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)
