"""Real OS-thread primitives, even inside a gevent worker.

gevent's monkey-patching turns a ``threading.Thread`` into a greenlet and a ``threading.Lock`` into a greenlet
lock. The project's gunicorn worker leaves threads native (``server/gunicorn_app.py``), but the scheduler must
run on a native thread (a decode step holds the CPU for milliseconds and must never block the event loop) with
locks that work between that thread and the hub's whatever patched the process, so it takes the originals.
"""

from __future__ import annotations

import _queue
import importlib
from collections.abc import Callable


def _original(module: str, name: str):
    try:
        from gevent import monkey
    except ImportError:  # gevent is only in the `serve` extra; without it nothing is patched
        return getattr(importlib.import_module(module), name)
    return monkey.get_original(module, name)


def start_native_thread(target: Callable[[], None]) -> int:
    """Run ``target`` on a new OS thread; returns its identifier."""
    return _original("_thread", "start_new_thread")(target, ())


def native_lock():
    return _original("_thread", "allocate_lock")()


# The C SimpleQueue is never patched: put() never blocks, get() blocks only the calling OS thread.
NativeQueue = _queue.SimpleQueue
QueueEmpty = _queue.Empty
