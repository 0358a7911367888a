"""Grammars of typed GLM tool calls: every walk through one parses (output_parser) into arguments that validate.

The walks are the demo model's prior without its network (``grammar_walk``), over its vocabulary.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm53.engine.constraints import compile_grammar
from glm53.server.parsing import parse_output
from glm53.server.parsing.call_grammar import CallGrammar, ToolSchemaError

from .grammar_walk import TOKENIZER, VOCABULARY, walk
from .json_schemas import TOOLS, WEATHER, parameters
from .schema_gen import parameters as parameter_schemas

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def typed_call(name: str, params: dict | None):
    g = CallGrammar(VOCABULARY.marker)
    return compile_grammar("lark", g.text(g.typed_call(name, params)), VOCABULARY)


def calls_of(text: str, tools: list[dict]):
    parsed = parse_output("<tool_call>" + text, tools, reasoning_open=False)
    assert parsed.content is None and parsed.reasoning is None, text
    return parsed.tool_calls


@pytest.mark.parametrize("tool", TOOLS, ids=lambda t: t["function"]["name"])
@pytest.mark.parametrize("seed", range(6))
def test_every_walk_is_one_call_whose_arguments_validate(tool, seed):
    name, params = tool["function"]["name"], tool["function"]["parameters"]
    text, ended = walk(typed_call(name, params), seed)
    assert ended, text
    (call,) = calls_of(text, TOOLS)
    assert call.name == name
    jsonschema.validate(json.loads(call.arguments), params)


REQUIRED = {"note": "n", "count": "1", "color": "red", "code": "AB1"}  # the mixed tool's required values, as written


def record_call(**values: str) -> str:
    """The text of a call to the mixed tool with the required values, overridden by ``values``, in declared order."""
    written = {**REQUIRED, **values}
    order = list(parameters(TOOLS, "record")["properties"])
    pairs = "".join(f"<arg_key>{k}</arg_key><arg_value>{written[k]}</arg_value>" for k in order if k in written)
    return f"record{pairs}</tool_call>"


@pytest.mark.parametrize("key,text,value", [
    ("note", "null", None), ("note", "nullish", "nullish"), ("note", " 12 ", " 12 "), ("count", "42", 42),
    ("count", "x42", "x42"), ("color", "green", "green"), ("box", '{"w": 3}', {"w": 3}), ("anything", "[1, 2]", [1, 2]),
    ("anything", "free text", "free text"), ("anything", "true", True), ("anything", '"quoted"', '"quoted"'), ("ratio", "0.5", 0.5), ("items", '["ab"]', ["ab"]),
])
def test_a_value_is_taken_in_every_shape_the_parser_reads_it(key, text, value):
    constraint = typed_call("record", parameters(TOOLS, "record")).start()
    call_text = record_call(**{key: text})
    for token in TOKENIZER.encode(call_text):
        constraint.advance(token)
    assert constraint.error is None and constraint.ended_at == constraint.tokens
    (call,) = calls_of(call_text, TOOLS)
    assert json.loads(call.arguments)[key] == value


@pytest.mark.parametrize("key,text", [
    ("note", "longer than twelve"), ("count", "1234567x"), ("code", "AB12"), ("color", '"red"'), ("color", "blue"),
    ("ratio", "2"), ("box", '{"w": "3"}'), ("items", '["abcde"]'),
])
def test_a_value_its_schema_refuses_is_not_allowed(key, text):
    constraint = typed_call("record", parameters(TOOLS, "record")).start()
    for token in TOKENIZER.encode(record_call(**{key: text})):
        constraint.advance(token)
    assert constraint.error is not None


@SETTINGS
@given(parameter_schemas(), st.integers(0, 2**16))
def test_generated_parameter_schemas(params, seed):
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    try:
        grammar = typed_call("f", params)
    except ToolSchemaError:
        return  # a schema the grammar cannot hold calls to is refused up front (tested below)
    text, ended = walk(grammar, seed)
    assert ended, text
    (call,) = calls_of(text, tools)
    jsonschema.validate(json.loads(call.arguments), params)


def test_a_call_without_parameters_is_its_name_alone():
    text, ended = walk(typed_call("get_time", None), 0)
    assert ended and text.replace("\n", "") == "get_time</tool_call>"  # a newline may stand before the closer


def test_a_raw_string_never_spells_out_the_marker_that_would_end_it():
    """The parser ends a value at the first "</arg_value>" text, token or spelled out: the grammar allows only the token."""
    constraint = typed_call("get_weather", parameters([WEATHER], "get_weather")).start()
    for token in TOKENIZER.encode("get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value"):
        constraint.advance(token)
    assert constraint.error is None
    constraint.advance(ord(">"))
    assert constraint.error is not None and "doesn't satisfy the grammar" in constraint.error


@pytest.mark.parametrize("params,where,why", [
    ({"type": "object", "minProperties": 1}, "", "minProperties"),
    ({"type": "object", "properties": {"a": {"type": "string", "allOf": [{"maxLength": 3}]}}}, "/properties/a", "allOf"),
    ({"type": "object", "properties": {" a": {"type": "string"}}, "required": [" a"]}, "/properties/ a", "cannot be written"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "/properties/a/$ref", "does not name"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}, {"enum": ["x"]}]}}}, "/properties/a", "oneOf"),
    ({"type": "object", "required": ["b"], "additionalProperties": False}, "/required", "not a property"),
])
def test_schemas_no_grammar_holds_are_refused_with_where_and_why(params, where, why):
    with pytest.raises(ToolSchemaError) as caught:
        CallGrammar(VOCABULARY.marker).typed_call("f", params)
    assert caught.value.path == where and why in str(caught.value)


def test_an_optional_property_that_cannot_be_written_is_left_out():
    params = {"type": "object", "properties": {"a </arg_key>": {"type": "string"}, "b": {"type": "integer"}}, "required": ["b"]}
    for seed in range(5):
        text, _ = walk(typed_call("f", params), seed)
        (call,) = calls_of(text, [{"type": "function", "function": {"name": "f", "parameters": params}}])
        assert list(json.loads(call.arguments)) == ["b"]

