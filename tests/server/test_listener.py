"""The listening address is bound before the server starts: a busy port stops ``glm53 serve`` at once, in one
sentence that says how to choose another."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from glm53.server import listener

from .servers import REPO


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_busy_port_is_one_sentence_naming_the_address_and_the_way_out(taken_port):
    with pytest.raises(listener.ListenError) as exc:
        listener.bind("127.0.0.1", taken_port)
    assert str(exc.value) == f"127.0.0.1:{taken_port} is already in use; choose another port with --port or GLM53_PORT"


def test_an_address_of_no_interface_here_says_which_setting_to_change():
    with pytest.raises(listener.ListenError) as exc:
        listener.bind("192.0.2.1", 30000)  # TEST-NET-1: no machine has it
    assert str(exc.value).startswith("cannot listen on 192.0.2.1:30000: ") and str(exc.value).endswith("--host or GLM53_HOST")


def test_a_free_port_is_held_from_the_bind_on():
    sock = listener.bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0 and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        with pytest.raises(listener.ListenError):
            listener.bind("127.0.0.1", port)  # a second server started meanwhile is refused
    finally:
        sock.close()


def test_serve_on_a_busy_port_exits_at_once_without_claiming_to_listen(taken_port):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    out = subprocess.run([sys.executable, "-m", "glm53", "serve", "--engine", "tiny", "--port", str(taken_port)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "listening" not in out.stdout + out.stderr and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"glm53: not starting: 127.0.0.1:{taken_port} is already in use; choose another port with --port or GLM53_PORT")
