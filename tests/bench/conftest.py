"""Fixtures shared by the bench tools' tests."""

from __future__ import annotations

import pytest

from tests.server.servers import Server


@pytest.fixture(scope="session")
def demo_server():
    """One CPU demo server (4k context, 4 jobs at once) for the tools that only need a server to talk to."""
    s = Server(["serve", "--engine", "tiny", "-cs", "4096", "--max-batch-size", "4"]).wait_ready()
    yield s
    s.stop()
