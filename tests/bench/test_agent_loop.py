"""bench/agent_loop.py against the CPU demo model: a turn row per API and turn, and a conversation too long for the
context stopped before it starts. The demo's prefix cache serves a next turn everything the turn before fed it, so the
prefill check passes; its times to first token are milliseconds of noise, so the TTFT check may go either way (the
GPU engine's: tests/gpu/test_agent_reuse.py)."""

from __future__ import annotations

from .tools import run_tool


def test_every_api_and_turn_gets_its_row(demo_server, tmp_path):
    rc, result, log = run_tool("agent_loop.py", tmp_path / "loop.json", "--url", demo_server.url, "--turns", "2", "--system-words", "60",
                               "--turn-words", "20", "--max-tokens", "8", timeout=300)
    assert rc in (0, 1) and result is not None, log  # rows for every turn, whichever way the TTFT check went
    assert set(result["turns"]) == {"chat", "messages", "responses"}
    assert [row["turn"] for row in result["warmup"]] == [1, 2]  # the unjudged warm-up conversation, on the first API
    for rows in result["turns"].values():
        first, second = rows
        # a new conversation shares only the template's first tokens with the ones before it
        assert first["turn"] == 1 and first["cached"] < 10 and first["uncached"] == first["prompt"] - first["cached"] > 60
        assert second["added"] == second["prompt"] - first["prompt"] > 20 and second["cached"] > first["prompt"]
        assert second["prefill_ok"] is True and second["fresh_ttft_s"] > 0


def test_a_conversation_past_the_context_stops_before_its_first_turn(demo_server, tmp_path):
    rc, result, log = run_tool("agent_loop.py", tmp_path / "loop.json", "--url", demo_server.url, "--turns", "3", "--system-words", "5000",
                               "--turn-words", "20", "--max-tokens", "8", timeout=120)
    assert rc == 2 and result is None, log
    assert "past its 4096-token context" in log and "tokens a word on this server" in log and "--system-words" in log
