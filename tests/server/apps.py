"""Apps in this process, for tests that need no real server: a fresh ``create_app`` per test, driven through
Flask's test client. No process to start or stop, no port, no HTTP on a socket.

Without gunicorn's gevent worker, nothing is monkey-patched: a request runs on the test's own thread, the
scheduler still on its native thread, and a job's events cross between them on thread-safe queues
(``server/bridge.py``); a grammar still compiles on gevent's thread pool, whose hub then runs in the test's thread.
What needs the worker stays on the real servers of ``servers.py``: streaming over a socket, clients that hang up
(``server/disconnect.py`` watches gunicorn's socket from a greenlet), SIGTERM draining, keep-alives, the listener,
and the official SDKs and agent CLIs, which talk to a real listener.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager

from flask import Flask
from flask.testing import FlaskClient

from glm53 import config
from glm53.engine.interface import Backend
from glm53.server import create_app

from . import scripted_server

READY_TIMEOUT_S = 30.0


class Client(FlaskClient):
    """Flask's test client, except that an answer is read to its end and closed before it is returned, as a server
    does once it has sent it: the request's access-log line and its count in the metrics exist by then."""

    def open(self, *args, buffered: bool = True, **kwargs):
        return super().open(*args, buffered=buffered, **kwargs)


@contextmanager
def running(settings: config.Settings, backend_factory: Callable[[], Backend] | None = None) -> Iterator[Flask]:
    """A new app with its model loaded; its scheduler is stopped on the way out."""
    app = create_app(settings, backend_factory)
    app.test_client_class = Client
    scheduler = app.extensions["glm53"].scheduler
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while scheduler.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.002)
        assert scheduler.state == "ready", f"the model did not load: {scheduler.state} {scheduler.error or ''}"
        yield app
    finally:
        scheduler.stop()


def scripted(argv: Sequence[str] = (), env: Mapping[str, str] | None = None) -> AbstractContextManager[Flask]:
    """An app over the scripted model of ``scripted_server`` (settings from flags and ``GLM53_*`` variables, none
    taken from this process's environment)."""
    settings = config.load(list(argv), env or {})
    return running(settings, scripted_server.backend_factory(settings))


def tiny(argv: Sequence[str] = (), env: Mapping[str, str] | None = None) -> AbstractContextManager[Flask]:
    """An app over the CPU demo model, as ``glm53 serve --engine tiny`` serves it."""
    return running(config.load(["--engine", "tiny", *argv], env or {}))
