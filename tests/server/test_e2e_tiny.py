"""The shared end-to-end suite on the CPU demo model, plus what only a fast CPU model can check in CI. The demo
model's answers at the edges of the API, which need no listener, run in-process: ``test_tiny_app.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .e2e_suite import *  # noqa: F403 - the shared tests run against this module's fixtures
from .servers import REPO, Server


@pytest.fixture(scope="module")
def server():
    s = Server(["serve", "--engine", "tiny", "--max-batch-size", "16", "-cs", "8192", "--sse-keepalive-s", "0.2"]).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def concurrency():
    return 16


def test_stream_rate_tool_passes_against_the_demo_model(server):
    def run():
        return subprocess.run(
            [sys.executable, "bench/stream_rate.py", "--url", server.url, "--max-tokens", "6500", "--ignore-eos"],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )

    out = run()
    if out.returncode != 0:
        # once more: on a 2-core machine shared with the Nix checks the demo model's rate can swing by a third within
        # a stream; a server that batches its events fails every time (about 25 % by the midpoint, a burst at the end)
        out = run()
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["pass"] and {p["path"] for p in report["paths"]} == {"chat", "generate"}
