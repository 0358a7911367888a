"""Notice a client that went away while its request waits, prefills or decodes.

A WSGI server learns of a closed connection only when a write fails, and a request that is queued or
prefilling writes nothing for a while. Under gevent a side greenlet therefore waits until the client's socket
turns readable: a client waiting for its response sends nothing, so readable means end of file (or a reset),
i.e. gone. Pipelined bytes (a client that sends its next request early) end the watch without a verdict.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from .bridge import gevent_active

log = logging.getLogger(__name__)


class DisconnectWatcher:
    def __init__(self, environ: dict, on_gone: Callable[[], None]):
        self._greenlet = None
        sock = environ.get("gunicorn.socket")
        if sock is None or not gevent_active():
            return  # write errors still end the stream; only the early notice is lost
        import gevent

        self._greenlet = gevent.spawn(self._watch, sock, on_gone)

    @staticmethod
    def _watch(sock: socket.socket, on_gone: Callable[[], None]) -> None:
        from gevent.socket import wait_read

        try:
            wait_read(sock.fileno())
            gone = sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            gone = True
        if gone:
            log.info("client disconnected; cancelling its request")
            on_gone()

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None
