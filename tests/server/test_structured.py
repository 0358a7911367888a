"""What a request asks of its answer, as one grammar: every walk through it reads back (parser, json, jsonschema)
as what was asked. Walks are the demo model's prior without its network (``grammar_walk``)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm53.server.errors import APIError
from glm53.server.parsing import parse_output
from glm53.server.protocol import ChatCompletionRequest
from glm53.server.structured import Structure, ToolSpec, call_prefix, compile_structure, from_openai

from .grammar_walk import VOCABULARY, walk
from .json_schemas import SCHEMAS, TOOLS, parameters
from .schema_gen import schemas

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
SPECS = tuple(ToolSpec(t["function"]["name"], t["function"]["parameters"], param=f"tools[{i}].function.parameters")
              for i, t in enumerate(TOOLS))


def grammar(structure: Structure, reasoning_open: bool = False):
    return compile_structure(structure, VOCABULARY, reasoning_open)


def assert_valid_calls(calls):
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), parameters(TOOLS, call.name))


@SETTINGS
@given(schemas(), st.integers(0, 2**16), st.booleans())
def test_a_json_answer_validates_after_free_reasoning_or_none(schema, seed, reasoning_open):
    text, ended = walk(grammar(Structure(schema), reasoning_open), seed)
    assert ended, text
    parsed = parse_output(text, None, reasoning_open)
    if reasoning_open:
        assert "</think>" not in (parsed.reasoning or "")  # the think block closed where the grammar says
    jsonschema.validate(json.loads(parsed.content), schema)


@pytest.mark.parametrize("name", SCHEMAS)
def test_hand_written_schemas(name):
    for seed in range(3):
        text, ended = walk(grammar(Structure(SCHEMAS[name])), seed)
        assert ended, text
        jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_calls_of_any_tool_that_validate(parallel):
    structure = Structure(tools=SPECS, tool_choice="required", parallel_tool_calls=parallel)
    assert call_prefix(structure) == "<tool_call>"
    names = set()
    for seed in range(12):
        text, ended = walk(grammar(structure), seed)
        calls = parse_output(call_prefix(structure) + text, TOOLS, reasoning_open=False).tool_calls
        assert ended and (len(calls) >= 1 if parallel else len(calls) == 1), text
        assert_valid_calls(calls)
        names |= {c.name for c in calls}
    assert len(names) > 1 and names <= {t["function"]["name"] for t in TOOLS}  # any tool, not always the same one


def test_a_named_function_gives_one_call_of_it():
    structure = Structure(tools=SPECS, tool_choice="record")
    assert call_prefix(structure) == "<tool_call>record"
    for seed in range(8):
        text, ended = walk(grammar(structure), seed)
        (call,) = parse_output(call_prefix(structure) + text, TOOLS, reasoning_open=False).tool_calls
        assert ended and call.name == "record"
        assert_valid_calls([call])


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_with_a_strict_tool_holds_calls_and_leaves_text_free(parallel):
    strict = tuple(ToolSpec(s.name, s.parameters, strict=True, param=s.param) for s in SPECS)
    structure = Structure(tools=strict, parallel_tool_calls=parallel)
    assert call_prefix(structure) == ""
    compiled = grammar(structure, reasoning_open=True)
    constraint = compiled.start()
    for token in VOCABULARY.ll.tokenize_str("free text, then") + [VOCABULARY.special_tokens["</think>"]]:
        constraint.advance(token)
    constraint.advance(VOCABULARY.special_tokens["<tool_call>"])
    for token in VOCABULARY.ll.tokenize_str("get_time"):
        constraint.advance(token)
    constraint.advance(VOCABULARY.special_tokens["</tool_call>"])
    assert constraint.error is None
    # one call ends the answer without parallel calls; with them, more text may follow
    assert (constraint.ended_at is None) == parallel


def test_auto_without_strict_tools_or_a_format_asks_for_nothing():
    assert grammar(Structure(tools=SPECS)) is None
    assert grammar(Structure()) is None


def test_a_json_answer_or_calls_when_tools_may_be_called():
    structure = Structure({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, tools=SPECS)
    constraint = grammar(structure).start()
    constraint.advance(VOCABULARY.special_tokens["<tool_call>"])
    assert constraint.error is None  # a call may stand in place of the JSON


def test_from_openai_maps_the_request_fields():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "record"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMAS["person"], "strict": True}},
    })
    s = from_openai(req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls)
    assert s.json_schema == SCHEMAS["person"] and s.tool_choice == "record" and not s.parallel_tool_calls
    assert [t.param for t in s.tools] == [f"tools[{i}].function.parameters" for i in range(len(TOOLS))]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                "tool_choice": "none", "response_format": {"type": "json_object"}})
    s = from_openai(req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls)
    assert s.json_schema == {"type": "object"} and s.tools == () and s.tool_choice == "auto"


@pytest.mark.parametrize("structure,param,why", [
    (Structure({"type": "object", "dependentRequired": {"a": ["b"]}}), "response_format.json_schema.schema", "dependentRequired"),
    (Structure({"type": "string", "format": "credit-card"}), "response_format.json_schema.schema", "format"),
    (Structure({"type": "strng"}), "response_format.json_schema.schema", "strng"),
    (Structure(tools=(ToolSpec("f", {"type": "object", "minProperties": 2}, param="tools[0].function.parameters"),),
               tool_choice="required"), "tools[0].function.parameters", "minProperties"),
    (Structure(tools=(ToolSpec("f", {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}},
                               strict=True, param="tools[3].function.parameters"),)), "tools[3].function.parameters", "regex"),
])
def test_a_schema_that_cannot_be_held_to_is_a_400_naming_its_field(structure, param, why):
    with pytest.raises(APIError) as caught:
        grammar(structure)
    err = caught.value
    assert err.status == 400 and err.param == param and err.message.startswith(param + ": ") and why in err.message


def test_a_loose_tool_schema_is_no_error_where_it_is_not_held_to():
    odd = ToolSpec("f", {"type": "object", "minProperties": 2}, param="tools[0].function.parameters")
    assert grammar(Structure({"type": "object"}, tools=(odd,))) is not None
