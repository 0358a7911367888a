"""The shared end-to-end suite on the CPU demo model, plus what only a fast CPU model can check in CI."""

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
    out = subprocess.run(
        [sys.executable, "bench/stream_rate.py", "--url", server.url, "--max-tokens", "6500", "--ignore-eos"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["pass"] and {p["path"] for p in report["paths"]} == {"chat", "generate"}


@pytest.mark.parametrize("extra", [
    {"temperature": 1e-300}, {"temperature": 100.0, "top_p": 5e-324}, {"top_k": 10**30}, {"min_p": 1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0}, {"logit_bias": {"0": 100, "1": -100}},
    {"seed": -(2**63)}, {"seed": 2**64 - 1, "n": 16},
])
def test_extreme_valid_sampling_values_are_served(server, extra):
    """The real sampler at the edges of what the API accepts: served, never an engine error."""
    code, resp = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "edge"}], "max_tokens": 4, **extra})
    assert code == 200, resp
    assert all(c["finish_reason"] in ("stop", "length") for c in resp["choices"])
    code, resp = server.post("/generate", {"text": "edge", "sampling_params": {"max_new_tokens": 4, "top_k": 10**30, "sampling_seed": -1, "temperature": 1e-300}})
    assert code == 200 and len(resp["output_ids"]) <= 4


def test_the_demo_model_has_no_prefix_cache_and_no_gpu(server):
    """A repeated prompt is prefilled again in full (the demo model keeps no prefix cache), and says so."""
    before = server.get("/stats")[1]["scheduler"]
    body = {"prompt": "the same prompt, twice " * 20, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        code, r = server.post("/v1/completions", body)
        assert code == 200 and r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    prompt_tokens = r["usage"]["prompt_tokens"]
    after = server.get("/stats")[1]["scheduler"]
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"] == 0
    assert after["prefix_cache_misses"] - before["prefix_cache_misses"] == 2 * prompt_tokens
    assert after["prefix_cache_hit_rate"] == 0.0
    code, info = server.get("/server_info")
    assert code == 200 and "gpu" in info and info["gpu"] is None
