"""End to end over real gunicorn + gevent with a scripted model: the OpenAI wire format, tools, reasoning, errors.

The official ``openai`` client is the arbiter of the wire format: a malformed chunk fails its parsing. What needs
no listener (refusals, body limits, the SGLang endpoints, observability, the API key) runs in-process, on a fresh
app per test: ``test_scripted_app.py``.
"""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from tests import loadgen

from .servers import Server, openai_client

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def server():
    s = Server(["--max-batch-size", "4", "-cs", "4096", "--max-request-mb", "1"], module="tests.server.scripted_server").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def stream_chunks(client, **kw):
    return list(client.chat.completions.create(model="glm-5.3-flash", stream=True, **kw))


def test_plain_answer_with_thinking_off(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi [[script:plain]]"), extra_body=NO_THINK)
    msg = r.choices[0].message
    assert msg.content == "Hello there, friend." and msg.role == "assistant"
    assert getattr(msg, "reasoning_content", None) is None and not msg.tool_calls
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.completion_tokens == len("Hello there, friend.") + 1  # plus the EOS token
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_reasoning_and_content_are_separated(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:think]]"))
    msg = r.choices[0].message
    assert msg.reasoning_content == "Let me think about it." and msg.content == "The answer is 4."


def test_streamed_reasoning_and_content_match_the_non_streamed_answer(client):
    chunks = stream_chunks(client, messages=user("[[script:think]]"))
    assert len({c.id for c in chunks}) == 1 and chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == ("Let me think about it.", "The answer is 4.")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["stop"]


def test_tool_call_non_streamed_typed_by_schema(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:weather]]"), tools=WEATHER_TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "I should look it up."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": " New York\n", "days": 3}
    assert choice.message.content is None


def test_tool_call_streamed_as_deltas(client):
    chunks = stream_chunks(client, messages=user("[[script:weather]]"), tools=WEATHER_TOOLS)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    first = calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function" and first.function.name == "get_weather"
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(args) == {"city": " New York\n", "days": 3}
    assert len(calls) > 2  # arguments arrive in fragments, not one piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_two_calls_and_a_zero_argument_call(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:two_calls]]"), tools=WEATHER_TOOLS)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [{}, {"city": "Paris"}]
    chunks = stream_chunks(client, messages=user("[[script:two_calls]]"), tools=WEATHER_TOOLS)
    indexes = sorted({tc.index for c in chunks for tc in (c.choices[0].delta.tool_calls or [])})
    assert indexes == [0, 1]


def test_a_call_inside_reasoning_is_not_swallowed(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:call_in_think]]"), tools=WEATHER_TOOLS)
    msg = r.choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["get_time"]
    assert msg.reasoning_content == "Checking done." and msg.content == "Here."


def test_unknown_tool_name_comes_back_as_content(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:unknown_tool]]"), tools=WEATHER_TOOLS)
    msg = r.choices[0].message
    assert not msg.tool_calls and "launch_rockets" in msg.content and r.choices[0].finish_reason == "stop"


STRICT_TOOLS = [{"type": "function", "function": {**t["function"], "strict": True}} for t in WEATHER_TOOLS]


def test_a_call_within_a_strict_schema_comes_out_unchanged(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:weather]]"), tools=STRICT_TOOLS)
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": " New York\n", "days": 3}
    assert r.choices[0].message.reasoning_content == "I should look it up." and r.choices[0].finish_reason == "tool_calls"


def test_a_call_the_model_opens_is_held_to_a_strict_tool(client):
    """The script calls an undeclared function; the grammar makes the scripted model call a declared one (it takes
    the lowest token the grammar allows where its script's is not)."""
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:unknown_tool]]"), tools=STRICT_TOOLS)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
    assert r.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_allows_one_call(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:two_calls]]"), tools=WEATHER_TOOLS,
                                       parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    # the answer ends with the first call: </think>, <tool_call>, the name's 8 bytes, </tool_call>
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens == 11


def test_response_format_holds_the_scripted_model_to_the_schema(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:plain]]"), response_format=fmt, extra_body=NO_THINK)
    assert json.loads(r.choices[0].message.content) == {"answer": "no"} and r.choices[0].finish_reason == "stop"


def test_tool_choice_none_leaves_markup_as_content(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:two_calls]]"), tools=WEATHER_TOOLS, tool_choice="none")
    assert not r.choices[0].message.tool_calls and "<tool_call>get_time" in r.choices[0].message.content


def test_named_tool_choice_starts_the_turn_with_that_call(client):
    r = client.chat.completions.create(
        model="glm-5.3-flash", messages=user("[[script:forced]]"), tools=WEATHER_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}


def test_stop_strings(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:stop_demo]]"), stop=["STOP", "zzz"], extra_body=NO_THINK)
    assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"


def test_max_tokens_gives_length(client):
    for field in ("max_tokens", "max_completion_tokens"):
        r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:plain]]"), extra_body=NO_THINK, **{field: 5})
        assert r.choices[0].message.content == "Hello" and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 5


def test_include_usage_chunk(client):
    chunks = stream_chunks(client, messages=user("[[script:plain]]"), stream_options={"include_usage": True}, extra_body=NO_THINK)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 21
    assert all(c.usage is None for c in chunks[:-1])
    chunks = stream_chunks(client, messages=user("[[script:plain]]"), extra_body=NO_THINK)
    assert all(c.usage is None for c in chunks) and chunks[-1].choices


def test_n_choices(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:plain]]"), n=3, extra_body=NO_THINK)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello there, friend." for c in r.choices)
    assert r.usage.completion_tokens == 3 * 21
    chunks = stream_chunks(client, messages=user("[[script:plain]]"), n=2, extra_body=NO_THINK)
    per_choice = {i: [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].finish_reason] for i in (0, 1)}
    assert per_choice == {0: ["stop"], 1: ["stop"]}


def test_cached_prompt_tokens_reach_every_usage_block_and_the_counters(server, client):
    """The scripted backend reports N cached prompt tokens for a prompt with ``[[cached:N]]``."""
    msgs = user("[[cached:7]] [[script:plain]]")
    r = client.chat.completions.create(model="glm-5.3-flash", messages=msgs, extra_body=NO_THINK)
    assert r.usage.prompt_tokens_details.cached_tokens == 7
    chunks = stream_chunks(client, messages=msgs, stream_options={"include_usage": True}, extra_body=NO_THINK)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 7
    # n samples of a prompt: the prompt is counted once in prompt_tokens, and so are its cached tokens
    r = client.chat.completions.create(model="glm-5.3-flash", messages=msgs, n=3, extra_body=NO_THINK)
    assert r.usage.prompt_tokens_details.cached_tokens == 7
    prompts = ["[[cached:3]] [[script:plain]]", "[[cached:5]] [[script:plain]]"]
    r = client.completions.create(model="glm-5.3-flash", prompt=prompts, n=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 3 + 5
    chunks = list(client.completions.create(model="glm-5.3-flash", prompt=prompts, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3 + 5
    r = client.completions.create(model="glm-5.3-flash", prompt="[[script:plain]]")
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    before = server.get("/stats")[1]["scheduler"]
    prompt = "[[cached:11]] [[script:plain]]"
    code, r = server.post("/generate", {"text": prompt})
    assert code == 200 and r["meta_info"]["cached_tokens"] == 11 and r["meta_info"]["prompt_tokens"] == len(prompt)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/generate", json.dumps({"text": prompt, "stream": True}), {"Content-Type": "application/json"})
    frames = [json.loads(line[6:]) for line in conn.getresponse().read().decode().splitlines() if line.startswith("data: {")]
    conn.close()
    assert len(frames) > 2 and {f["meta_info"]["cached_tokens"] for f in frames} == {11}
    after = server.get("/stats")[1]["scheduler"]
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 2 * 11
    assert after["prefix_cache_misses"] - before["prefix_cache_misses"] == 2 * (len(prompt) - 11)
    metrics = loadgen.metrics(server.port)
    assert metrics["glm53_prefix_cache_hit_tokens_total"] == after["prefix_cache_hits"]
    assert metrics["glm53_prefix_cache_miss_tokens_total"] == after["prefix_cache_misses"]
    assert metrics["glm53_prefix_cache_hit_rate"] == after["prefix_cache_hit_rate"]


def test_chat_logprobs_one_entry_per_token_streamed_and_not(client):
    kw = {"messages": user("hi [[script:plain]]"), "extra_body": NO_THINK, "logprobs": True, "top_logprobs": 2}
    r = client.chat.completions.create(model="glm-5.3-flash", **kw)
    content = r.choices[0].logprobs.content
    assert r.choices[0].logprobs.refusal is None and len(content) == r.usage.completion_tokens
    assert [e.token for e in content] == list("Hello there, friend.") + ["<eos>"]  # the EOS token is generated too
    assert {e.logprob for e in content} == {-0.5} and all(e.bytes == list(e.token.encode()) for e in content)
    assert [(t.token, t.logprob, t.bytes) for t in content[0].top_logprobs] == [("H", -0.5, [72]), ("I", -1.5, [73])]
    chunks = stream_chunks(client, **kw)
    streamed = [e for chunk in chunks for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there, friend."


def test_chat_logprobs_keep_the_bytes_of_split_characters(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:unicode]]"), logprobs=True)
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content) == "</think>Grüße, 世界 😀!<eos>".encode()
    at = [e.bytes for e in content].index([0xBC])  # the second byte of "ü"
    assert [(e.token, e.bytes) for e in content[at - 1 : at + 1]] == [("\\xc3", [0xC3]), ("\\xbc", [0xBC])]
    assert all(e.top_logprobs == [] for e in content)
    assert r.choices[0].message.content == "Grüße, 世界 😀!"


def test_no_logprobs_unless_asked(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:plain]]"), extra_body=NO_THINK)
    assert r.choices[0].logprobs is None
    assert all(c.logprobs is None for chunk in stream_chunks(client, messages=user("[[script:plain]]")) for c in chunk.choices)


def test_unicode_survives_streaming(client):
    chunks = stream_chunks(client, messages=user("[[script:unicode]]"))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Grüße, 世界 😀!"


def test_completions_endpoint(client):
    r = client.completions.create(model="glm-5.3-flash", prompt="[[script:plain]]")
    assert r.choices[0].text == "Hello there, friend." and r.choices[0].finish_reason == "stop" and r.object == "text_completion"
    r = client.completions.create(model="glm-5.3-flash", prompt=["[[script:plain]]", "[[script:stop_demo]]"], max_tokens=5)
    assert [c.text for c in r.choices] == ["Hello", "alpha"]
    r = client.completions.create(model="glm-5.3-flash", prompt="[[script:plain]]", echo=True, max_tokens=3)
    assert r.choices[0].text == "[[script:plain]]Hel"
    chunks = list(client.completions.create(model="glm-5.3-flash", prompt="[[script:plain]]", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello there, friend."
    assert chunks[-1].usage.prompt_tokens == len("[[script:plain]]")


def test_models_endpoint(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["glm-5.3-flash"]
    assert client.models.retrieve("glm-5.3-flash").id == "glm-5.3-flash"


def test_oversize_chunked_body_without_a_length_is_413(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        chunks = (b"x" * 65536 for _ in range(32))  # 2 MB against a 1 MB limit, with no Content-Length
        conn.request("POST", "/v1/chat/completions", body=chunks, headers={"Content-Type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 413 and "too large" in json.loads(resp.read())["error"]["message"]
    finally:
        conn.close()


def test_engine_failure_mid_stream_ends_that_stream_and_the_server_keeps_serving(client):
    with pytest.raises(openai.APIError):
        stream_chunks(client, messages=user("[[script:fail]]"), extra_body=NO_THINK)
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("[[script:plain]]"), extra_body=NO_THINK)
    assert r.choices[0].message.content == "Hello there, friend."

