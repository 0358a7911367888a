"""Run the app under gunicorn: a gevent worker class and exactly one worker.

One worker because the model is loaded once, in that worker (each worker would load its own copy). The app is
built after the fork (no preload), so the model, CUDA and the scheduler thread live in the worker only. A model
that fails to load makes the worker exit with gunicorn's "app failed to load" code, which stops the arbiter
instead of restarting the worker into the same failure.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter
from gunicorn.workers.ggevent import GeventWorker as _GunicornGeventWorker

from ..config import Settings
from ..engine.interface import Backend
from . import create_app

log = logging.getLogger("glm53.server")


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


class GunicornServer(BaseApplication):
    def __init__(self, settings: Settings, backend_factory: Callable[[], Backend] | None = None):
        self.settings = settings
        self.backend_factory = backend_factory
        super().__init__()

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
            "graceful_timeout": 30,  # SIGTERM: in-flight streams get this long to finish
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


def serve(settings: Settings, backend_factory: Callable[[], Backend] | None = None) -> None:
    GunicornServer(settings, backend_factory).run()
