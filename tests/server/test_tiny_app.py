"""The CPU demo model's app in this process (``apps.py``: a fresh ``create_app`` per test, Flask's test client): the
real sampler at the edges of what the API accepts, and the figures of a model without a prefix cache or a GPU.
The shared end-to-end suite on this model is ``test_e2e_tiny.py``."""

from __future__ import annotations

import json

import pytest

from . import apps


@pytest.fixture
def client():
    # the settings of test_e2e_tiny.py's server
    with apps.tiny(["--max-batch-size", "16", "-cs", "8192", "--sse-keepalive-s", "0.2"]) as app:
        yield app.test_client()


@pytest.mark.parametrize("extra", [
    {"temperature": 1e-300}, {"temperature": 100.0, "top_p": 5e-324}, {"top_k": 10**30}, {"min_p": 1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0}, {"logit_bias": {"0": 100, "1": -100}},
    {"seed": -(2**63)}, {"seed": 2**64 - 1, "n": 16},
])
def test_extreme_valid_sampling_values_are_served(client, extra):
    """The real sampler at the edges of what the API accepts: served, never an engine error."""
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "edge"}], "max_tokens": 4, **extra})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert all(c["finish_reason"] in ("stop", "length") for c in r.get_json()["choices"])
    r = client.post("/generate", json={"text": "edge", "sampling_params": {"max_new_tokens": 4, "top_k": 10**30, "sampling_seed": -1,
                                                                          "temperature": 1e-300}})
    assert r.status_code == 200 and len(r.get_json()["output_ids"]) <= 4


def test_a_repeated_prompt_is_served_from_the_prefix_cache_and_there_is_no_gpu(client):
    """The demo model keeps finished sequences' keys and values: a repeated prompt prefills only its last token (the
    one whose logits give the answer's first), reports the rest as cached, and answers the same (greedy)."""
    before = client.get("/stats").get_json()["scheduler"]
    body = {"prompt": "the same prompt, twice " * 20, "max_tokens": 2, "temperature": 0}
    answers = []
    for _ in range(2):
        r = client.post("/v1/completions", json=body)
        answers.append((r.status_code, r.get_json()["choices"][0]["text"], r.get_json()["usage"]))
    (first_status, first_text, first), (second_status, second_text, second) = answers
    prompt_tokens = first["prompt_tokens"]
    assert (first_status, second_status, first_text) == (200, 200, second_text)
    assert (first["prompt_tokens_details"], second["prompt_tokens_details"]) == ({"cached_tokens": 0}, {"cached_tokens": prompt_tokens - 1})
    after = client.get("/stats").get_json()["scheduler"]
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == prompt_tokens - 1
    assert after["prefix_cache_misses"] - before["prefix_cache_misses"] == prompt_tokens + 1
    r = client.get("/server_info")
    info = r.get_json()
    assert r.status_code == 200 and "gpu" in info and info["gpu"] is None


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}}}


def _streamed_message(response) -> tuple[str, dict, str]:
    """The content, the tool calls' names and joined arguments by index, and the finish reason of an SSE answer."""
    content, calls, finish = "", {}, None
    for line in response.get_data(as_text=True).splitlines():
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[len("data: "):])["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name") or ""
            entry["arguments"] += call.get("function", {}).get("arguments") or ""
        finish = choice["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_leaks_no_markup_into_the_content(client, choice):
    named = choice != "required"
    for max_tokens in (1, 2, 3, 6, 12):
        body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "tool_choice": choice,
                "max_tokens": max_tokens, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.get_data(as_text=True)
        (answer,) = r.get_json()["choices"]
        assert answer["finish_reason"] == "length" and answer["message"]["content"] is None, (max_tokens, answer)
        tool_calls = answer["message"].get("tool_calls") or []
        if named:
            assert [c["function"]["name"] for c in tool_calls] == ["get_weather"], (max_tokens, answer)
        for c in tool_calls:
            assert isinstance(json.loads(c["function"]["arguments"]), dict)
        content, streamed, finish = _streamed_message(client.post("/v1/chat/completions", json={**body, "stream": True}))
        assert content == "" and finish == "length", (max_tokens, content)
        assert [c["name"] for c in streamed.values()] == [c["function"]["name"] for c in tool_calls], max_tokens
