"""Channels that carry a job's events from the scheduler's OS thread to the request that waits for them.

Inside the gunicorn gevent worker the request is a greenlet. gevent primitives must not be touched from a
foreign thread, so the scheduler thread only appends to a deque and calls ``send()`` on one async watcher of
the hub (the one thread-safe way into a gevent loop); the watcher's callback, on the hub, sets the gevent
Event each waiting greenlet sleeps on. No event waits for the next decode step, and nothing polls.

Without gevent (a plain threaded WSGI server, the Flask test client), a channel is a thread-safe queue.
"""

from __future__ import annotations

import queue
from collections import deque


def gevent_active() -> bool:
    """Whether requests run as greenlets (the gevent worker patches sockets; it leaves threads native)."""
    try:
        from gevent import monkey
    except ImportError:
        return False
    return monkey.is_module_patched("socket")


class _HubWaker:
    """One async watcher per hub; wakes the channels named by the scheduler thread."""

    def __init__(self):
        from gevent import get_hub

        self._pending: deque[_GeventChannel] = deque()  # deque.append/popleft are atomic across threads
        self._watcher = get_hub().loop.async_()
        self._watcher.start(self._wake)

    def notify(self, channel: _GeventChannel) -> None:  # any thread
        self._pending.append(channel)
        self._watcher.send()

    def _wake(self) -> None:  # on the hub
        while self._pending:
            self._pending.popleft()._ready.set()


_waker: _HubWaker | None = None


def _hub_waker() -> _HubWaker:
    # only greenlets of the one hub get here, and they do not switch inside this function: no lock needed
    global _waker
    if _waker is None:
        _waker = _HubWaker()
    return _waker


class _GeventChannel:
    def __init__(self):
        from gevent.event import Event

        self._items: deque = deque()
        self._ready = Event()
        self._waker = _hub_waker()

    def put(self, item) -> None:  # any thread, never blocks
        self._items.append(item)
        self._waker.notify(self)

    def get_all(self, timeout: float | None) -> list:
        """Everything that arrived, waiting up to ``timeout`` seconds for the first item ([] on timeout)."""
        if not self._items:
            self._ready.wait(timeout)
        self._ready.clear()  # cleared before draining: a wake-up for items drained now only costs a spurious loop
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out


class _ThreadChannel:
    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        self._q.put(item)

    def get_all(self, timeout: float | None) -> list:
        try:
            out = [self._q.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out


Channel = _GeventChannel | _ThreadChannel


def make_channel() -> Channel:
    return _GeventChannel() if gevent_active() else _ThreadChannel()
