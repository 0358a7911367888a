"""The scripted model's app in this process (``apps.py``: a fresh ``create_app`` per test, Flask's test client):
what every API refuses and with which status and shape, the limits on bodies, the SGLang endpoints, the
observability endpoints and the API key. What needs a real listener (the SDKs, streams read off a socket, chunked
bodies) is in ``test_e2e_scripted.py``, ``test_anthropic.py`` and ``test_responses_api.py``.
"""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest

from . import apps
from .scripted_server import SCORE_LIMIT

# the settings of test_e2e_scripted.py's server
FLAGS = ["--max-batch-size", "4", "-cs", "4096", "--max-request-mb", "1"]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture
def app():
    with apps.scripted(FLAGS) as app:
        yield app


@pytest.fixture
def client(app):
    return app.test_client()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def post_raw(client, path: str, raw: bytes):
    return client.post(path, data=raw, content_type="application/json")


# ----- /v1/chat/completions: refusals and limits

@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 1000}, 400, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 1000}, 400, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, 400, "tools.0.function.parameters"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 5}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": "no"}}, 400, "chat_template_kwargs.enable_thinking"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": -2}, 400, "top_k"),
        ({"messages": [{"role": "user", "content": "x"}], "min_p": 1.5}, 400, "min_p"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": -2.5}, 400, "presence_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 3}, 400, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": 2**64}, 400, "seed"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["ok", "\udfff"]}, 400, "stop.1"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, 400, "tools.0.function.parameters"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]}, 400, "tools.0.function.parameters"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": ["object", "null"]}}}]}, 400, "tools.0.function.parameters"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}]}, 400, "tools.0.function.parameters"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": {"type": "function"}}, 400, "tools"),
    ],
)
def test_bad_chat_requests_get_clear_4xx(client, body, status, param):
    # the body as JSON text: json.dumps escapes lone surrogates, as the e2e client's does
    r = post_raw(client, "/v1/chat/completions", json.dumps(body).encode())
    assert r.status_code == status, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_context_length_error_quotes_the_numbers(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "context_length_exceeded"
    assert "4096" in r.get_json()["error"]["message"]


@pytest.mark.parametrize(
    "raw,fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "not valid UTF-8"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "not valid JSON"),
        (b"[" * 100000 + b"]" * 100000, "nests too deeply"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1e400}', "top_p: Input should be a finite number"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_k": -Infinity}', "not valid JSON"),
    ],
)
def test_malformed_bodies(client, raw, fragment):
    r = post_raw(client, "/v1/chat/completions", raw)
    assert r.status_code == 400 and fragment in r.get_json()["error"]["message"]


def test_oversize_body_is_413(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 2_000_000}]})
    assert r.status_code == 413 and r.get_json()["error"]["type"] == "invalid_request_error"
    assert "at most 1000000 bytes are accepted (GLM53_MAX_REQUEST_MB)" in r.get_json()["error"]["message"]


POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/generate", "/tokenize", "/detokenize"]


@pytest.mark.parametrize("path", POST_PATHS)
def test_every_post_endpoint_refuses_broken_bodies_with_a_400_or_413(client, path):
    cases = [
        (b'{"text": "\xff"}', 400, "not valid UTF-8"),
        (b"[" * 5000 + b"]" * 5000, 400, "nests too deeply"),
        (b'{"x": ' * 200 + b"1" + b"}" * 200, 400, "nests more than 128 levels"),
        (b'{"x": NaN}', 400, "not valid JSON"),
        (b'{"text": "a\\ud800b"}', 400, "unpaired UTF-16 surrogate"),
        (b'{"x": "' + b"y" * 1_100_000 + b'"}', 413, "too large"),
    ]
    for raw, status, fragment in cases:
        r = post_raw(client, path, raw)
        assert (r.status_code, fragment in r.get_json()["error"]["message"]) == (status, True), (raw[:40], r.get_data(as_text=True))


@pytest.mark.parametrize("field", ["chat_template_kwargs", "tool_arguments", "content_part", "tool_schema"])
def test_nesting_just_under_the_limit_is_served_or_refused_but_never_a_500(client, field):
    deep: object = "leaf"
    for _ in range(120):
        deep = {"a": deep}
    body = {"messages": user("[[script:plain]]"), "max_tokens": 3}
    if field == "chat_template_kwargs":
        body["chat_template_kwargs"] = {"x": deep}
    elif field == "tool_arguments":
        body["messages"] = body["messages"] + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": deep}}]}]
    elif field == "content_part":
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "x", "extra": deep}]}]
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"p": deep}}}}]
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code in (200, 400), r.get_data(as_text=True)


def test_huge_max_tokens_is_capped_to_the_context(client):
    body = {"messages": user("[[script:plain]]"), "max_tokens": 10**30, "ignore_eos": True, **NO_THINK}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.get_json()["choices"][0]["finish_reason"] == "length"
    assert r.get_json()["usage"]["total_tokens"] == 4096  # the context of this server
    r = client.post("/generate", json={"text": "[[script:plain]]", "sampling_params": {"max_new_tokens": 10**30, "top_k": 10**30}})
    assert r.status_code == 200 and r.get_json()["text"] == "Hello there, friend."


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 5000}, "stop"),
    ("/generate", {"text": "x", "sampling_params": {"stop": ["s"] * 5000}}, "sampling_params.stop"),
    ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": list(range(5000))}}, "sampling_params.stop_token_ids"),
])
def test_thousands_of_stop_strings_are_refused_with_the_limit(client, path, body, param):
    r = client.post(path, json=body)
    err = r.get_json()["error"]
    assert r.status_code == 400 and err["param"] == param and ("64" in err["message"] or "1024" in err["message"])


def test_the_most_stop_strings_allowed_are_served(client):
    r = client.post("/v1/chat/completions", json={"messages": user("[[script:stop_demo]]"), "stop": ["q" * 1024] * 63 + ["STOP"], **NO_THINK})
    assert r.status_code == 200 and r.get_json()["choices"][0]["message"]["content"] == "alpha beta "


def test_tool_schemas_with_odd_property_shapes_still_parse_calls(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": {"not": "a type name"}}, "days": 5}}}}]
    r = client.post("/v1/chat/completions", json={"messages": user("[[script:weather]]"), "tools": tools})
    assert r.status_code == 200, r.get_data(as_text=True)
    (call,) = r.get_json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] == " New York\n"


def test_unknown_endpoint_and_wrong_method_are_json(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.get_json()["error"]["message"] == "no such endpoint"
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.get_json()


def test_engine_failure_non_streamed_is_a_500_with_a_reason(client):
    r = client.post("/v1/chat/completions", json={"messages": user("[[script:fail]]")})
    assert r.status_code == 500 and "injected engine failure" in r.get_json()["error"]["message"]


# ----- the SGLang endpoints

def test_generate_text_ids_and_stream(client):
    r = client.post("/generate", json={"text": "[[script:plain]]", "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    out = r.get_json()
    assert r.status_code == 200 and out["text"] == "Hello" and out["output_ids"] == list(b"Hello")
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    ids = list(b"[[script:plain]]")
    out = client.post("/generate", json={"input_ids": ids, "sampling_params": {"stop": "there"}}).get_json()
    assert out["text"] == "Hello " and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "there"}
    r = client.post("/generate", json={"text": "x", "sampling_params": {"max_tokens": 5}})
    bad = r.get_json()
    assert r.status_code == 400 and bad["error"]["param"] == "sampling_params.max_tokens" and "unknown field" in bad["error"]["message"]


def test_generate_teacher_forced_logprobs(client):
    ids = list(b"[[script:plain]]")
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1,
            "token_ids_logprob": [72], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    r = client.post("/generate", json=body)
    out = r.get_json()
    meta = out["meta_info"]
    assert r.status_code == 200 and out["output_ids"] == [ord("H")]
    assert meta["input_token_logprobs"][0] == [None, ids[0], None]
    assert [e[0] for e in meta["input_token_logprobs"][1:4]] == [-1.0, -2.0, -3.0]
    assert meta["output_token_logprobs"] == [[-0.5, 72, None]]
    assert meta["output_top_logprobs"] == [[[-0.5, 72, None]]]
    assert len(meta["input_top_logprobs"]) == len(ids)


def test_scoring_more_tokens_than_one_forward_takes_is_a_400_naming_the_limit(client):
    body = {"input_ids": [65] * (SCORE_LIMIT + 1), "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0}}
    r = client.post("/generate", json=body)
    err = r.get_json()["error"]
    assert r.status_code == 400 and err["param"] == "input_ids"
    assert f"at most {SCORE_LIMIT} tokens" in err["message"] and f"has {SCORE_LIMIT + 1}" in err["message"]
    body["input_ids"] = [65] * SCORE_LIMIT
    r = client.post("/generate", json=body)
    assert r.status_code == 200 and len(r.get_json()["meta_info"]["input_token_logprobs"]) == SCORE_LIMIT


def test_tokenize_and_detokenize(client):
    r = client.post("/tokenize", json={"text": "héllo"})
    assert r.status_code == 200 and r.get_json()["tokens"] == list("héllo".encode()) and r.get_json()["count"] == 6
    r = client.post("/detokenize", json={"tokens": list("héllo".encode())})
    assert r.get_json() == {"text": "héllo"}


# ----- observability and the API key

def test_observability_endpoints(client):
    r = client.post("/v1/chat/completions", json={"messages": user("[[script:plain]]")})
    assert r.status_code == 200  # something for the counters to count
    r = client.get("/server_info")
    info = r.get_json()
    assert r.status_code == 200 and info["settings"]["max_batch_size"] == 4 and info["setting_sources"]["max_batch_size"] == "flag"
    assert info["context_length"] == 4096 and info["settings"]["api_key"] is None
    stats = client.get("/stats").get_json()
    assert stats["scheduler"]["state"] == "ready" and stats["scheduler"]["completion_tokens"] > 0
    r = client.get("/metrics")
    text = r.get_data(as_text=True)
    assert r.status_code == 200 and 'glm53_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "glm53_time_to_first_token_seconds_bucket" in text and "glm53_engine_steps" in text


def test_api_key(caplog):
    caplog.set_level(logging.INFO)  # what the server's log would hold
    with apps.scripted(["-cs", "4096"], {"GLM53_API_KEY": "sk-test-123"}) as app:
        client = app.test_client()
        r = client.post("/v1/chat/completions", json={"messages": user("x")})
        assert r.status_code == 401 and r.get_json()["error"]["code"] == "invalid_api_key"
        r = client.post("/v1/chat/completions", json={"messages": user("x")}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = client.post("/v1/chat/completions", json={"messages": user("x")}, headers={"Authorization": "Bearer sk-test-123"})
        assert r.status_code == 200
        assert client.get("/health").status_code == 200
        info = client.get("/server_info", headers={"Authorization": "Bearer sk-test-123"}).get_json()
        assert info["settings"]["api_key"] == "<redacted>"
    assert caplog.records and "sk-test-123" not in caplog.text


# ----- /v1/messages (the settings of test_anthropic.py's server)

ANTHROPIC_KEY = "sk-test-anthropic"
MODEL = "glm-5.3-flash"


@pytest.fixture
def anthropic_client():
    with apps.scripted(["--max-batch-size", "4", "-cs", "4096"], {"GLM53_API_KEY": ANTHROPIC_KEY}) as app:
        yield app.test_client()


@pytest.mark.parametrize("body,field", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "w", "type": "web_search_20250305"}]}, "tools.0"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "output_config.format.schema"),
])
def test_bad_input_gets_anthropics_400_naming_the_field(anthropic_client, body, field):
    r = anthropic_client.post("/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": ANTHROPIC_KEY})
    err = r.get_json()
    assert r.status_code == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(field), err


def test_output_config_format_is_held_to_its_schema_and_any_tool_choice_always_calls(anthropic_client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = anthropic_client.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": user("[[script:plain]]"),
                                                    "output_config": {"format": {"type": "json_schema", "schema": schema}}},
                              headers={"x-api-key": ANTHROPIC_KEY})
    msg = r.get_json()
    assert r.status_code == 200, msg
    jsonschema.validate(json.loads(msg["content"][0]["text"]), schema)
    # the scripted model says "Hello world"; "any" holds it to a call anyway (an enum: the script's words cannot
    # close an unbounded string)
    pick = {"name": "pick", "input_schema": {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}}
    r = anthropic_client.post("/v1/messages", json={"model": MODEL, "max_tokens": 200, "messages": user("[[script:plain]]"),
                                                    "tools": [pick], "tool_choice": {"type": "any"}}, headers={"x-api-key": ANTHROPIC_KEY})
    msg = r.get_json()
    assert r.status_code == 200 and msg["stop_reason"] == "tool_use", msg
    (call,) = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert call["name"] == "pick" and call["input"]["c"] in ("red", "blue")


# ----- /v1/responses (the settings of test_responses_api.py's server)

@pytest.fixture
def responses_client():
    with apps.scripted(["--max-batch-size", "4", "-cs", "4096", "--responses-store", "2"]) as app:
        yield app.test_client()


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input.0.arguments"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0"),
])
def test_bad_input_gets_openais_400_naming_the_field(responses_client, body, param):
    r = responses_client.post("/v1/responses", json={"model": MODEL, **body})
    err = r.get_json()
    assert r.status_code == 400 and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"].startswith(param), err
