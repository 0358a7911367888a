"""The server's address, bound before anything else starts.

gunicorn binds only once its arbiter runs, and on a busy port it retries for five seconds and ends in "Can't
connect". Binding here first turns every such failure into one sentence at once, and holds the port from the
moment the server says where it listens; gunicorn takes the listening socket over as it is (``gunicorn_app``).
"""

from __future__ import annotations

import errno
import socket

BACKLOG = 2048  # gunicorn's default
# What to change, by the reason a bind failed
_PORT_HINT = "choose another port with --port or GLM53_PORT"
_HOST_HINT = "choose another address with --host or GLM53_HOST"
_HINTS = {
    errno.EADDRNOTAVAIL: ("it is not an address of this machine", _HOST_HINT),
    errno.EACCES: ("permission denied (ports below 1024 need privileges)", _PORT_HINT),
}


def bind_address(host: str, port: int) -> str:
    """``host:port`` as gunicorn's ``bind`` setting and people write it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ListenError(OSError):
    """The address cannot be bound; the message is one sentence naming it and what to change."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port``, with the options gunicorn sets.

    :raise ListenError: the port is in use, the host is not an address of this machine or does not resolve, or
        the port needs privileges.
    """
    address = bind_address(host, port)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {address}: the host name does not resolve ({exc.strerror}); {_HOST_HINT}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT by a restart is free
        sock.bind(sockaddr)
        # listening at once: a socket that is only bound does not keep another server from the port
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(f"{address} is already in use; {_PORT_HINT}") from None
        reason, hint = _HINTS.get(exc.errno, (exc.strerror, _PORT_HINT))
        raise ListenError(f"cannot listen on {address}: {reason}; {hint}") from None
    return sock
