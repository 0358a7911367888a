"""End-to-end tests of constrained decoding, shared by every engine: real gunicorn + gevent, the official openai
client. A test module imports them and provides the fixture ``server`` (a started ``Server``).

Every schema bounds its strings and arrays (``json_schemas.py`` says why), so whatever the model, an answer
ends within ``MAX_TOKENS``. Every answer is checked the way a client would: ``json.loads`` and ``jsonschema``.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from .json_schemas import E2E_TOOLS, SCHEMAS, parameters
from .servers import openai_client

MAX_TOKENS = 1500
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "Answer as asked."}]


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def chat(client, stream: bool, **kw) -> list[dict]:
    """Each choice's content, tool calls (arguments as text) and finish_reason, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model="glm-5.3-flash", messages=USER, max_tokens=MAX_TOKENS, **kw)
        return [{"content": c.message.content, "finish": c.finish_reason,
                 "calls": [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]} for c in r.choices]
    out: dict[int, dict] = {}
    calls: dict[tuple[int, int], list] = {}
    for chunk in client.chat.completions.create(model="glm-5.3-flash", messages=USER, max_tokens=MAX_TOKENS, stream=True, **kw):
        for c in chunk.choices:
            choice = out.setdefault(c.index, {"content": None, "finish": None, "calls": []})
            if c.delta.content:
                choice["content"] = (choice["content"] or "") + c.delta.content
            for t in c.delta.tool_calls or []:
                call = calls.setdefault((c.index, t.index), [None, ""])
                call[0] = t.function.name or call[0]
                call[1] += t.function.arguments or ""
            if c.finish_reason is not None:
                assert choice["finish"] is None, "two finish_reasons for one choice"
                choice["finish"] = c.finish_reason
    for (index, _), (name, arguments) in sorted(calls.items()):
        out[index]["calls"].append((name, arguments))
    return [out[i] for i in sorted(out)]


def assert_calls_validate(choice: dict, one: bool = False) -> None:
    assert choice["finish"] == "tool_calls" and choice["content"] is None and choice["calls"], choice
    assert len(choice["calls"]) == 1 or not one, choice
    for name, arguments in choice["calls"]:
        jsonschema.validate(json.loads(arguments), parameters(E2E_TOOLS, name))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_answers_parse_and_validate(client, name, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    for choice in chat(client, stream, seed=7, response_format=fmt, extra_body=NO_THINK):
        assert choice["finish"] == "stop" and not choice["calls"], choice
        jsonschema.validate(json.loads(choice["content"]), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_answers_are_objects(client, stream):
    for choice in chat(client, stream, n=2, seed=3, response_format={"type": "json_object"}, extra_body=NO_THINK):
        assert choice["finish"] == "stop" and isinstance(json.loads(choice["content"]), dict), choice


class City(BaseModel):
    name: Annotated[str, Field(max_length=20)]
    population: Annotated[int, Field(ge=0, le=10**8)]
    kind: Literal["city", "town"]
    districts: Annotated[list[Annotated[str, Field(max_length=8)]], Field(max_length=3)]
    mayor: Annotated[str, Field(max_length=12)] | None


def test_parse_with_a_pydantic_model_returns_the_object(client):
    r = client.chat.completions.parse(model="glm-5.3-flash", messages=USER, response_format=City, max_tokens=MAX_TOKENS,
                                      seed=11, extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, City)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_always_calls_with_valid_arguments(client, stream, parallel):
    for choice in chat(client, stream, n=2, seed=5, tools=E2E_TOOLS, tool_choice="required", parallel_tool_calls=parallel):
        assert_calls_validate(choice, one=not parallel)


# every tool non-streamed, one streamed (the required-choice tests stream every tool)
@pytest.mark.parametrize("tool,stream", [(t, False) for t in E2E_TOOLS] + [(E2E_TOOLS[0], True)],
                         ids=lambda v: v["function"]["name"] if isinstance(v, dict) else str(v))
def test_a_named_tool_choice_calls_it_once_with_valid_arguments(client, tool, stream):
    name = tool["function"]["name"]
    choices = chat(client, stream, n=2, seed=9, tools=E2E_TOOLS, tool_choice={"type": "function", "function": {"name": name}})
    for choice in choices:
        assert_calls_validate(choice, one=True)
        assert choice["calls"][0][0] == name


def test_strict_tools_under_auto_answer_freely_or_call_validly(client):
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in E2E_TOOLS]
    r = client.chat.completions.create(model="glm-5.3-flash", messages=USER, max_tokens=300, n=2, seed=2, tools=strict,
                                       extra_body=NO_THINK)
    for c in r.choices:
        choice = {"content": c.message.content, "finish": c.finish_reason,
                  "calls": [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]}
        assert choice["finish"] in ("stop", "length", "tool_calls"), choice
        if choice["calls"]:
            assert_calls_validate(choice)


def test_completions_and_generate_follow_their_grammars(server):
    code, r = server.post("/v1/completions", {"prompt": "JSON:", "max_tokens": MAX_TOKENS, "n": 2, "seed": 1,
                                              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}}})
    assert code == 200 and all(c["finish_reason"] == "stop" for c in r["choices"]), r
    for c in r["choices"]:
        jsonschema.validate(json.loads(c["text"]), SCHEMAS["person"])
    schema = json.dumps(SCHEMAS["union"])
    code, r = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": MAX_TOKENS, "json_schema": schema}})
    assert code == 200 and r["meta_info"]["finish_reason"]["type"] == "stop", r
    jsonschema.validate(json.loads(r["text"]), SCHEMAS["union"])
    code, r = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 64, "regex": "(yes|no)-[0-9]{2}"}})
    assert code == 200 and r["text"] in {f"{w}-{n:02d}" for w in ("yes", "no") for n in range(100)}, r
    code, r = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 64, "ebnf": 'root ::= "a" [0-9] "b"'}})
    assert code == 200 and len(r["text"]) == 3 and r["text"][0] + r["text"][2] == "ab" and r["text"][1].isdigit(), r


def test_a_constrained_answer_cut_by_max_tokens_says_length(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}}
    r = client.chat.completions.create(model="glm-5.3-flash", messages=USER, max_tokens=5, response_format=fmt, extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


@pytest.mark.parametrize("body,param,says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "unevaluatedProperties": False}}}},
     "response_format.json_schema.schema", "unevaluatedProperties"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}},
     "response_format.json_schema.schema", "regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ({"tools": [E2E_TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "maxProperties": 1}}}],
      "tool_choice": "required"}, "tools[1].function.parameters", "maxProperties"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[z-a]"}}}}}]}, "tools[0].function.parameters", "regex"),
])
def test_a_schema_that_cannot_be_held_to_is_a_400_naming_the_field(server, body, param, says):
    code, r = server.post("/v1/chat/completions", {"messages": USER, **body})
    assert code == 400 and r["error"]["param"] == param and says in r["error"]["message"], r
    assert r["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("params,param", [
    ({"json_schema": "{not json"}, "sampling_params.json_schema"),
    ({"regex": "(("}, "sampling_params.regex"),
    ({"ebnf": "root ::= ("}, "sampling_params.ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "sampling_params"),
])
def test_a_generate_grammar_that_does_not_compile_is_a_400(server, params, param):
    code, r = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, **params}})
    assert code == 400 and r["error"]["param"] == param, r
