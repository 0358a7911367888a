"""A bounded soak of the CPU demo model over real gunicorn + gevent (``soak.py``): a mix of every generating
endpoint, streamed and not, with clients that hang up mid-stream, for SOAK_SECONDS (60 in CI; set the environment
variable for a longer manual run). No request may fail, the worker's resident memory must stay flat after a
warm-up, and ``/metrics`` must account for every request and every job.
"""

from __future__ import annotations

import os

import pytest

from . import soak
from .servers import Server

SOAK_S = float(os.environ.get("SOAK_SECONDS", "60"))
CLIENTS = 12
RSS_GROWTH_BOUND = 32 * 2**20


@pytest.fixture(scope="module")
def server():
    s = Server(["serve", "--engine", "tiny", "--max-batch-size", "8", "-cs", "2048"]).wait_ready()
    yield s
    s.stop()


def test_soak(server):
    result = soak.run(server, SOAK_S, CLIENTS)
    f = result.figures()
    rss = f["rss_mib"]
    print(f"\nsoak: {f['seconds']:.0f} s, {CLIENTS} clients, {f['requests']} requests {f['kinds']}, {f['failures']} failures; "
          f"worker RSS {rss['start']} MiB at start, {rss['after_warmup']} MiB after warm-up, {rss['end']} MiB at the end "
          f"(growth {rss['growth_after_warmup']:+.1f} MiB, peak {rss['peak']} MiB); latency {f['latency_s']}")
    assert soak.problems(result, RSS_GROWTH_BOUND) == []
