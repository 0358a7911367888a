"""Run the app under gunicorn: a gevent worker class and exactly one worker.

One worker because the model is loaded once, in that worker (each worker would load its own copy). The app is
built after the fork (no preload), so the model, CUDA and the scheduler thread live in the worker only. A model
that fails to load makes the worker exit with gunicorn's "app failed to load" code, which stops the arbiter
instead of restarting the worker into the same failure. SIGTERM drains the worker (``server/drain.py``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from functools import partial

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter
from gunicorn.sock import create_sockets
from gunicorn.workers.ggevent import GeventWorker as _GunicornGeventWorker

from ..config import Settings
from ..engine.interface import Backend
from . import create_app
from .listener import bind, bind_address

log = logging.getLogger(__name__)

# After the grace period the remaining jobs are cancelled; their streams then need a moment to write the error
# event and close. gunicorn's arbiter kills the worker this long after the grace period.
CANCEL_FLUSH_S = 2.0
ARBITER_MARGIN_S = 5.0


def _exit_worker(reason: str) -> None:
    log.error("stopping the server: the model failed to load (%s)", reason)
    logging.shutdown()
    os._exit(Arbiter.APP_LOAD_ERROR)  # from the loader thread: nothing else in the worker can be trusted now


class GeventWorker(_GunicornGeventWorker):
    """gunicorn's gevent worker, patching only what requests use: sockets (and DNS, SSL).

    The scheduler is a native OS thread that runs CUDA, Triton and torch. Triton compiles kernels through
    subprocesses, waits for them with ``os.waitpid`` and reads them through ``selectors``; exllamav3 keeps thread
    pools. gevent's versions of those, used from a foreign thread, fail or wait forever for an event that only
    the main hub would see (seen on the GPU machine: a patched subprocess raised "child watchers are only
    available on the default loop"; with a patched os and select, requests hung at the first new kernel).
    Requests never sleep, wait on threads, queues or processes, so patching less costs the event loop nothing.
    """

    def patch(self):
        from gevent import monkey, socket

        monkey.patch_all(
            socket=True, dns=True, ssl=True,
            time=False, select=False, thread=False, os=False, subprocess=False, sys=False,
            signal=False, queue=False,
        )
        # the listening sockets were made before patching: re-wrap them as gevent sockets
        self.sockets = [socket.socket(s.FAMILY, socket.SOCK_STREAM, fileno=s.sock.detach()) for s in self.sockets]

    def init_process(self):
        self._in_flight = 0  # requests between their first byte read and their last byte written
        super().init_process()

    def handle_exit(self, sig, frame):
        """SIGTERM: start draining. Only flags are set here (this runs in a signal handler); ``run`` does the rest."""
        self.alive = False  # gunicorn closes each connection after its current response from now on
        app = getattr(self, "wsgi", None)  # None: the signal came before the app was built; nothing to drain
        if app is not None:
            app.extensions["glm53"].drain.begin()

    def handle_request(self, *args):
        self._in_flight += 1
        try:
            return super().handle_request(*args)
        finally:
            self._in_flight -= 1

    def run(self):
        """gunicorn's gevent loop, except that SIGTERM keeps the listener open until the drain is over.

        gunicorn's own loop closes the listening socket at once, so clients arriving during the drain would
        be refused, and waits for idle keep-alive connections as if they were requests.
        """
        from gevent import sleep
        from gevent.pool import Pool
        from gevent.server import StreamServer

        servers = []
        for s in self.sockets:
            s.setblocking(1)
            server = StreamServer(s, handle=partial(self.handle, s), spawn=Pool(self.worker_connections))
            server.start()
            servers.append(server)
        while self.alive:
            self.notify()
            sleep(1.0)
        if getattr(self, "wsgi", None) is not None:
            self._drain(sleep)
        for server in servers:
            server.close()  # stop accepting; idle keep-alive connections close with the process, a moment later

    def _drain(self, sleep) -> None:
        rt = self.wsgi.extensions["glm53"]
        grace = rt.settings.shutdown_grace_s
        log.info("SIGTERM: draining %d request(s) in flight for up to %.0f s; new requests get 503", self._in_flight, grace)
        deadline = rt.drain.started + grace
        while self._in_flight and time.monotonic() < deadline:
            self.notify()
            sleep(0.05)
        if self._in_flight:
            log.warning("grace period over with %d request(s) in flight: cancelling them", self._in_flight)
            rt.scheduler.stop()
            flush_deadline = time.monotonic() + CANCEL_FLUSH_S
            while self._in_flight and time.monotonic() < flush_deadline:
                sleep(0.05)
        log.info("drained in %.2f s; %d request(s) still open", time.monotonic() - rt.drain.started, self._in_flight)


class GunicornServer(BaseApplication):
    def __init__(self, settings: Settings, listener: socket.socket, backend_factory: Callable[[], Backend] | None = None):
        """:param listener: the bound socket of the server's address (``listener.bind``); gunicorn listens on it."""
        self.settings = settings
        self.listener = listener
        self.backend_factory = backend_factory
        super().__init__()

    def run(self):
        # the arbiter takes sockets it finds in LISTENERS as they are, instead of binding (and retrying) itself
        arbiter = Arbiter(self)
        arbiter.LISTENERS = create_sockets(self.cfg, arbiter.log, [self.listener.detach()])
        arbiter.run()

    def load_config(self) -> None:
        s = self.settings
        for key, value in {
            "bind": bind_address(s.host, s.port),
            "workers": 1,
            "worker_class": "glm53.server.gunicorn_app.GeventWorker",
            "worker_connections": max(1000, 4 * (s.max_batch_size + s.max_queue)),
            # a gevent worker heartbeats from its hub, which never blocks on the model: a generous limit only
            # guards against a wedged process, and loading happens off the hub
            "timeout": 120,
            # the worker drains for shutdown_grace_s, then cancels what is left (GeventWorker.run); the arbiter
            # kills it only if that somehow did not end it
            "graceful_timeout": math.ceil(s.shutdown_grace_s + CANCEL_FLUSH_S + ARBITER_MARGIN_S),  # gunicorn takes whole seconds
            "keepalive": 75,  # longer than common proxies' idle timeouts
            "preload_app": False,
            "proc_name": "glm53",
            "accesslog": None,
            "errorlog": "-",
            "loglevel": "info",
        }.items():
            self.cfg.set(key, value)
        if "control_socket_disable" in self.cfg.settings:  # gunicorn >= 24: a control socket nothing here uses,
            self.cfg.set("control_socket_disable", True)  # at one fixed path per user (servers would collide)

    def load(self):
        return create_app(self.settings, self.backend_factory, on_load_failure=_exit_worker)


def serve(settings: Settings, backend_factory: Callable[[], Backend] | None = None, listener: socket.socket | None = None) -> None:
    """Run the server until it is stopped.

    :param listener: the address, bound already (``listener.bind``); default: bound here.
    :raise ListenError: the address cannot be bound.
    """
    GunicornServer(settings, listener or bind(settings.host, settings.port), backend_factory).run()
