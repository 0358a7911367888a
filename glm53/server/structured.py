"""Structured output: what a request asks to be guaranteed about its answer, as one grammar for the engine.

Each API maps its request onto a :class:`Structure` (``from_openai`` for OpenAI chat; the Anthropic Messages and
OpenAI Responses modules map theirs the same way): an answer held to a JSON schema, the tools the model may call,
whether it must call one (and which), one call or several. Then, with the same two calls on every API:

- ``call_prefix(structure)``: the text the prompt ends with when a call is forced (``<tool_call>``, or
  ``<tool_call>NAME``): the turn starts inside the call, after an empty think block;
- ``compile_structure(structure, vocabulary, reasoning_open)``: the compiled grammar every choice is held to
  (``GenerationRequest.grammar``), or None when nothing is asked. Compiling runs on a worker thread, off the
  event loop, and a schema that cannot be held to is a 400 naming the field it came from.

The grammars, in llguidance's Lark dialect (``parsing/call_grammar.py`` writes the calls):

- a JSON answer: ``[reasoning </think>] JSON``. A think block the prompt left open stays free text (any text but
  ``</think>``); the JSON follows it at once. With callable tools, calls may stand in place of the JSON.
- ``required``: after the prompt's ``<tool_call>``, a typed call of any tool; more whole calls when parallel.
- a named function: after the prompt's ``<tool_call>NAME``, that tool's typed arguments: one call.
- ``auto`` with a strict tool, or with ``parallel_tool_calls`` false: free text and special tokens, where each
  call is typed (a strict tool) or loose (any other); at most one call when not parallel.

Typed calls are held to their tool's schema: a forced call's always, an ``auto`` call's when the tool is strict.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.constraints import CompiledGrammar, GrammarError, Vocabulary, compile_grammar, with_json_layout
from .errors import APIError
from .parsing.call_grammar import CallGrammar, ToolSchemaError
from .parsing.output_parser import CALL_OPEN, THINK_CLOSE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: Mapping[str, Any] | None  # a JSON schema of type object (None: no arguments)
    strict: bool = False  # its calls are held to ``parameters`` even when the model chose to call
    param: str = "tools"  # the request field that holds ``parameters``, named in a 400


@dataclass(frozen=True)
class Structure:
    """What a request asks of its answer, in no API's wire shape."""

    json_schema: Mapping[str, Any] | None = None  # the answer is one JSON value valid against this schema
    schema_param: str = "response_format.json_schema.schema"  # where the schema came from, named in a 400
    tools: Sequence[ToolSpec] = ()  # the functions the model may call (none when the request turned tools off)
    tool_choice: str = "auto"  # "auto", "required" (some call), or the name of the function it must call
    parallel_tool_calls: bool = True  # False: one call at most


def from_openai(response_format, tools, tool_choice, parallel_tool_calls: bool | None) -> Structure:
    """The Structure of an OpenAI chat request's ``response_format``, ``tools``, ``tool_choice`` (validated wire
    types of ``protocol.py``) and ``parallel_tool_calls``."""
    schema = None
    if response_format is not None and response_format.type == "json_object":
        schema = {"type": "object"}
    elif response_format is not None and response_format.type == "json_schema":
        schema = response_format.json_schema.schema_ if response_format.json_schema.schema_ is not None else {}
    specs = []
    if tools and tool_choice != "none":
        specs = [ToolSpec(t.function.name, t.function.parameters, bool(t.function.strict), f"tools[{i}].function.parameters")
                 for i, t in enumerate(tools)]
    if tool_choice is None or isinstance(tool_choice, str):
        choice = "required" if tool_choice == "required" else "auto"
    else:
        choice = tool_choice.function.name
    return Structure(schema, tools=tuple(specs), tool_choice=choice, parallel_tool_calls=parallel_tool_calls is not False)


def call_prefix(structure: Structure) -> str:
    """What the prompt ends with for a forced call (the grammar starts after it); "" when no call is forced."""
    if not structure.tools or structure.tool_choice == "auto":
        return ""
    return CALL_OPEN + ("" if structure.tool_choice == "required" else structure.tool_choice)


def compile_structure(structure: Structure, vocabulary: Vocabulary, reasoning_open: bool) -> CompiledGrammar | None:
    """The grammar of ``structure`` for a prompt that ends inside a think block (``reasoning_open``) or not.

    :raise 400: a schema that cannot be held to: names the field (``structure.schema_param``, a tool's ``param``)
        and the reason.
    """
    try:
        text = grammar_text(structure, vocabulary, reasoning_open)
    except GrammarError as exc:  # the model's tokenizer lacks a marker the grammar needs
        raise APIError(400, f"this model cannot hold its output to the requested structure: {exc}", code="unsupported_structure") from None
    if text is None:
        return None
    try:
        return _compile("lark", text, vocabulary)
    except GrammarError as exc:
        raise _blame(structure, vocabulary, exc) from None


def compile_request_grammar(kind: str, source: str, vocabulary: Vocabulary, param: str) -> CompiledGrammar:
    """A grammar the client wrote itself (``/generate``'s json_schema, regex, ebnf). :raise 400: naming ``param``."""
    try:
        return _compile(kind, source, vocabulary)
    except GrammarError as exc:
        raise APIError(400, f"{param}: cannot be compiled: {exc}", param=param, code="invalid_grammar") from None


def grammar_text(structure: Structure, vocabulary: Vocabulary, reasoning_open: bool) -> str | None:
    """The Lark text of ``structure``'s grammar (see the module docstring), None when it asks for nothing.

    :raise 400: a tool schema that cannot be held to.
    """
    g = CallGrammar(vocabulary.marker)
    tools = list({t.name: t for t in structure.tools}.values())  # a repeated name: the last wins, as in the parser
    choice = structure.tool_choice if tools else "auto"
    if choice == "required":
        call = g.add(" | ".join(_typed(g, t) for t in tools))
        more = f" ({g.marker(CALL_OPEN)} {call})*" if structure.parallel_tool_calls else ""
        return g.text(call + more)
    if choice != "auto":
        tool = next((t for t in tools if t.name == choice), None)
        if tool is None:
            raise APIError(400, f"tool_choice names {choice!r}, which is not among the tools", param="tool_choice")
        return g.text(_typed(g, tool, arguments_only=True))
    if structure.json_schema is not None:
        answer = g.add("%json " + json.dumps(with_json_layout(dict(structure.json_schema))))
        if tools:
            answer = g.add(f"{answer} | {_calls(g, tools, structure.parallel_tool_calls)}")
        if reasoning_open:
            return g.text(f"{g.free_text(THINK_CLOSE)} {g.marker(THINK_CLOSE)} {answer}")
        return g.text(answer)
    if tools and (any(t.strict for t in tools) or not structure.parallel_tool_calls):
        return g.text(_free_with_calls(g, tools, structure.parallel_tool_calls, vocabulary))
    return None


def _typed(g: CallGrammar, tool: ToolSpec, arguments_only: bool = False) -> str:
    try:
        return g.typed_arguments(tool.parameters) if arguments_only else g.typed_call(tool.name, tool.parameters)
    except ToolSchemaError as exc:
        raise APIError(400, f"{tool.param}: cannot hold calls of {tool.name!r} to this schema: {exc}",
                       param=tool.param, code="unsupported_schema") from None


def _calls(g: CallGrammar, tools: list[ToolSpec], parallel: bool) -> str:
    """A rule for one call (several when ``parallel``) of any of ``tools``, each typed if its tool is strict."""
    body = g.add(" | ".join(_typed(g, t) if t.strict else g.loose_call(t.name) for t in tools))
    call = g.add(f"{g.marker(CALL_OPEN)} {body}")
    return f"{call}+" if parallel else call


def _free_with_calls(g: CallGrammar, tools: list[ToolSpec], parallel: bool, vocabulary: Vocabulary) -> str:
    """Anything the model may write unconstrained, except that a call (opened by ``<tool_call>``) is a call."""
    text = g.free_text(CALL_OPEN)  # text, never the call marker spelled out
    call = _calls(g, tools, parallel=False)
    opener = vocabulary.special_tokens.get(CALL_OPEN)
    # every special token but the call opener; the end tokens are allowed wherever the grammar may end
    others = sorted(set(vocabulary.special_tokens.values()) - {opener} - vocabulary.eos_ids)
    special = f"<[{_ranges(others)}]>" if others else None
    if parallel:
        item = g.add(" | ".join(filter(None, [special, call])))
        return f"{text} ({item} {text})*"
    return f"{text} ({special} {text})* {call}?" if special else f"{text} {call}?"


def _ranges(ids: list[int]) -> str:
    """Sorted ids as llguidance's token ranges: "3-5,9"."""
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in out)


def _compile(kind: str, text: str, vocabulary: Vocabulary) -> CompiledGrammar:
    """``compile_grammar`` on gevent's thread pool: a large schema can take long to compile, and the event loop
    serves every other stream meanwhile. :raise GrammarError:"""
    from gevent import get_hub

    # the error comes back as a value: gevent's pool reports an exception raised in it as a crash
    result = get_hub().threadpool.apply(_compile_or_error, (kind, text, vocabulary))
    if isinstance(result, GrammarError):
        raise result
    return result


def _compile_or_error(kind: str, text: str, vocabulary: Vocabulary) -> CompiledGrammar | GrammarError:
    try:
        return compile_grammar(kind, text, vocabulary)
    except GrammarError as exc:
        return exc


def _blame(structure: Structure, vocabulary: Vocabulary, error: GrammarError) -> APIError:
    """The 400 for a structure whose grammar did not compile: each part is compiled alone to find the culprit."""
    choice = structure.tool_choice if structure.tools else "auto"
    if structure.json_schema is not None and choice == "auto":
        try:
            _compile("json_schema", json.dumps(structure.json_schema), vocabulary)
        except GrammarError as exc:
            param = structure.schema_param
            return APIError(400, f"{param}: this JSON schema cannot be held to: {exc}", param=param, code="unsupported_schema")
    # the tools whose schemas are in the grammar: every one for "required", the named one, strict ones for "auto"
    for tool in [t for t in structure.tools if choice in ("required", t.name) or (choice == "auto" and t.strict)]:
        g = CallGrammar(vocabulary.marker)
        try:
            _compile("lark", g.text(_typed(g, tool)), vocabulary)
        except GrammarError as exc:
            return APIError(400, f"{tool.param}: cannot hold calls of {tool.name!r} to this schema: {exc}",
                            param=tool.param, code="unsupported_schema")
    log.warning("a structure's grammar did not compile, though each part does: %s", error)
    return APIError(400, f"the requested output structure cannot be compiled: {error}", code="unsupported_schema")
