"""``/v1/messages`` end to end over real gunicorn + gevent with a scripted model, the official ``anthropic`` SDK as
the arbiter of the wire format (an event out of order or a malformed block fails its stream accumulator). Its
refusals and output formats without an SDK run in-process: ``test_scripted_app.py``."""

from __future__ import annotations

import http.client
import json

import anthropic
import pytest

from .scripted_server import AGENT_ANSWER
from .servers import Server

KEY = "sk-test-anthropic"
MODEL = "glm-5.3-flash"
WEATHER = {"name": "get_weather", "description": "Forecast", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
THINK = {"type": "enabled", "budget_tokens": 2048}


@pytest.fixture(scope="module")
def server():
    s = Server(["--max-batch-size", "4", "-cs", "4096"], env={"GLM53_API_KEY": KEY}, module="tests.server.scripted_server").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    yield c
    c.close()


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_plain_answer_without_thinking(client):
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=ask("hi [[script:plain]]"))
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello there, friend."
    assert (msg.role, msg.type, msg.stop_reason, msg.stop_sequence) == ("assistant", "message", "end_turn", None)
    assert msg.usage.output_tokens == len("Hello there, friend.") + 1  # and the EOS token
    assert msg.usage.input_tokens > 0 and msg.usage.cache_read_input_tokens == 0


def test_thinking_block_then_text(client):
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=ask("[[script:think]]"), thinking=THINK)
    thinking, text = msg.content
    assert (thinking.type, thinking.thinking, text.text) == ("thinking", "Let me think about it.", "The answer is 4.")
    assert thinking.signature  # carries the reasoning back with the history (agent_turn.seal_reasoning)


def test_cached_prompt_tokens_are_reported_apart_from_the_rest(client):
    msg = client.messages.create(model=MODEL, max_tokens=50, messages=ask("[[cached:20]] [[script:plain]]"))
    count = client.messages.count_tokens(model=MODEL, messages=ask("[[cached:20]] [[script:plain]]"))
    assert msg.usage.cache_read_input_tokens == 20
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == count.input_tokens


def test_stream_helper_gives_the_same_message_as_the_plain_call(client):
    kwargs = {"model": MODEL, "max_tokens": 300, "messages": ask("[[script:weather]]"), "tools": [WEATHER], "thinking": THINK}
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        thinking_deltas = [e.thinking for e in stream if e.type == "thinking"]
        final = stream.get_final_message()
    assert "".join(thinking_deltas) == "I should look it up."
    assert [b.type for b in final.content] == [b.type for b in plain.content] == ["thinking", "tool_use"]
    call = final.content[1]
    assert (call.name, call.input) == ("get_weather", {"city": " New York\n", "days": 3})
    assert call.id.startswith("toolu_") and final.stop_reason == plain.stop_reason == "tool_use"
    assert final.usage.output_tokens == plain.usage.output_tokens


def sse_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed answer, read off the wire (the SDK drops pings)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/messages", json.dumps({**body, "stream": True}), {"x-api-key": KEY, "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    text = resp.read().decode()
    conn.close()
    events = []
    for frame in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if not line.startswith(":"))
        if lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_event_sequence_on_the_wire(server):
    events = sse_events(server, {"model": MODEL, "max_tokens": 200, "messages": ask("[[script:think]]"), "thinking": THINK})
    assert all(name == data["type"] for name, data in events)
    kinds = [name for name, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [(d["index"], d["content_block"]["type"]) for k, d in events if k == "content_block_start"]
    assert blocks == [(0, "thinking"), (1, "text")]
    assert [d["index"] for k, d in events if k == "content_block_stop"] == [0, 1]
    deltas = [d["delta"]["type"] for k, d in events if k == "content_block_delta"]
    assert deltas == ["thinking_delta"] * len("Let me think about it.") + ["signature_delta"] + ["text_delta"] * len("The answer is 4.")
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None} and end["usage"]["output_tokens"] > 0


def test_tool_use_loop_with_the_result_sent_back(client):
    messages = ask("What is the weather? [[script:agent_weather]]")
    first = client.messages.create(model=MODEL, max_tokens=300, messages=messages, tools=[WEATHER], thinking=THINK)
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert (call.name, call.input) == ("get_weather", {"city": "Oslo"})
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]}]
    with client.messages.stream(model=MODEL, max_tokens=300, messages=messages, tools=[WEATHER], thinking=THINK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == AGENT_ANSWER + "sunny, 21 C" and final.stop_reason == "end_turn"


def test_omitted_thinking_is_returned_in_the_signature_only(client):
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=ask("[[script:think]]"),
                                 thinking={"type": "adaptive", "display": "omitted"})
    assert (msg.content[0].type, msg.content[0].thinking) == ("thinking", "")
    assert msg.content[1].text == "The answer is 4."


def test_forced_tool_choice_starts_the_turn_with_the_call(client):
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=ask("[[script:forced]]"),
                                 tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = msg.content
    assert (call.type, call.name, call.input, msg.stop_reason) == ("tool_use", "get_weather", {"city": "Oslo"}, "tool_use")


def test_stop_sequence_and_max_tokens_stop_reasons(client):
    stopped = client.messages.create(model=MODEL, max_tokens=200, messages=ask("[[script:stop_demo]]"), stop_sequences=["STOP"])
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == ("alpha beta ", "stop_sequence", "STOP")
    cut = client.messages.create(model=MODEL, max_tokens=5, messages=ask("[[script:plain]]"))
    assert (cut.content[0].text, cut.stop_reason, cut.usage.output_tokens) == ("Hello", "max_tokens", 5)


def test_errors_the_sdk_raises_by_type(server, client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="not-this-model", max_tokens=10, messages=ask("x"))
    assert missing.value.body["error"]["type"] == "not_found_error"
    wrong_key = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong_key.messages.create(model=MODEL, max_tokens=10, messages=ask("x"))
    assert denied.value.body["error"]["type"] == "authentication_error"
    code, body = server.post("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": ask("[[script:plain]]")},
                             headers={"Authorization": "Bearer " + KEY, "anthropic-version": "2023-06-01"})
    assert code == 200 and body["content"][0]["text"] == "Hello"
