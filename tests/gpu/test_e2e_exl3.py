"""The shared end-to-end suite against the GPU engine on the tiny synthetic checkpoint."""

from __future__ import annotations

import pytest

from tests.server.e2e_suite import *  # noqa: F403 - the shared tests run against this module's fixtures
from tests.server.servers import Server


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = Server(
        ["serve", "--engine", "exl3", "-m", str(tiny_checkpoint), "-cs", "16384", "--max-batch-size", "4", "-ambs", "4",
         "-chunk_size", "2048", "--sse-keepalive-s", "0.2"]
    ).wait_ready(timeout=600)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def concurrency():
    return 4


def test_server_reports_the_checkpoint(server):
    code, info = server.get("/server_info")
    assert code == 200 and info["model"]["architecture"] == "Glm5NextForConditionalGeneration"
    assert info["model"]["chat_template"] == "checkpoint tokenizer_config.json"
    assert info["model"]["decode_slots"] == 4 and info["load_seconds"] > 0


def test_tool_request_round_trip(server):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    code, r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "time?"}], "tools": tools, "max_tokens": 24})
    assert code == 200 and r["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_thinking_off_prompt_has_an_empty_think_block(server):
    code, r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                                   "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0})
    assert code == 200 and r["choices"][0]["message"]["reasoning_content"] is None
