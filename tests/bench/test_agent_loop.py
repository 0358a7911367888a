"""bench/agent_loop.py against the CPU demo model: a turn row per API and turn, and a conversation too long for the
context stopped before it starts. (The demo keeps no prefix cache, so its turns do not pass the reuse check; the
GPU engine's do: tests/gpu/test_agent_reuse.py.)"""

from __future__ import annotations

from .tools import run_tool


def test_every_api_and_turn_gets_its_row(demo_server, tmp_path):
    rc, result, log = run_tool("agent_loop.py", tmp_path / "loop.json", "--url", demo_server.url, "--turns", "2", "--system-words", "60",
                               "--turn-words", "20", "--max-tokens", "8", timeout=300)
    assert rc == 1 and result is not None, log  # rows for every turn; the demo caches nothing, so reuse fails
    assert set(result["turns"]) == {"chat", "messages", "responses"} and result["passed"] is False
    assert [row["turn"] for row in result["warmup"]] == [1, 2]  # the unjudged warm-up conversation, on the first API
    for rows in result["turns"].values():
        first, second = rows
        assert first["turn"] == 1 and first["cached"] == 0 and first["uncached"] == first["prompt"] > 60
        assert second["added"] == second["prompt"] - first["prompt"] > 20 and second["prefill_ok"] is False
        assert second["fresh_ttft_s"] > 0


def test_a_conversation_past_the_context_stops_before_its_first_turn(demo_server, tmp_path):
    rc, result, log = run_tool("agent_loop.py", tmp_path / "loop.json", "--url", demo_server.url, "--turns", "3", "--system-words", "5000",
                               "--turn-words", "20", "--max-tokens", "8", timeout=120)
    assert rc == 2 and result is None, log
    assert "past its 4096-token context" in log and "tokens a word on this server" in log and "--system-words" in log
