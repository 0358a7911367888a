"""Graceful shutdown: on SIGTERM the server drains instead of dropping its clients.

While draining, requests already in flight run to completion; new requests get 503 with ``Retry-After`` (and
``Connection: close``, set by gunicorn once the worker is no longer alive), and ``/health`` says ``draining`` so
probes and load balancers take the server out of rotation. The listening socket stays open the whole time: a
refused connection looks like a dead server, while a 503 tells a client to retry, elsewhere or later. When
nothing is in flight, or the grace period (``GLM53_SHUTDOWN_GRACE_S``) is over, the worker cancels what is
left (those streams end with an error event and ``[DONE]``) and exits; the sequence is driven by the worker
class in ``server/gunicorn_app.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flask import Flask, request

from .errors import APIError, json_error

# Read-only endpoints that keep answering while draining: /health reports the drain, /metrics lets an operator
# watch it.
OPEN_WHILE_DRAINING = frozenset({"/health", "/metrics"})
RETRY_AFTER_S = 5


@dataclass
class Drain:
    started: float | None = None  # time.monotonic() of the SIGTERM

    @property
    def active(self) -> bool:
        return self.started is not None

    def begin(self) -> None:
        """Start draining (idempotent: a second SIGTERM changes nothing). Safe in a signal handler."""
        if self.started is None:
            self.started = time.monotonic()


def init_app(app: Flask, drain: Drain) -> None:
    @app.before_request
    def _refuse_while_draining():
        if drain.active and request.path not in OPEN_WHILE_DRAINING:
            err = APIError(503, "the server is shutting down; retry on another instance or after it restarts",
                           code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
            return json_error(err)
        return None
