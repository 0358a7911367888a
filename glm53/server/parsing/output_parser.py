"""Incremental parser of GLM-5 model output into reasoning, content and tool calls.

One state machine serves streamed and non-streamed responses: ``parse_output`` is a single ``feed`` plus
``finish`` on the same parser, so both paths give the same result for the same text, however it was chunked.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from glm53.server.parsing.arguments import (
    STRING_ONLY,
    decode_json,
    dump_json,
    encode_value,
    tool_properties,
    value_types,
)
from glm53.server.parsing.events import (
    ContentText,
    Event,
    ParsedOutput,
    ReasoningText,
    ToolCallArguments,
    ToolCallBegin,
    ToolCallEnd,
    collect,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
JSON_BODY = "{"

# Inside a key only its closer is expected; any other marker means the pair is malformed.
KEY_MARKERS = (KEY_CLOSE, KEY_OPEN, VALUE_OPEN, VALUE_CLOSE, CALL_OPEN, CALL_CLOSE)


class State(Enum):
    START = "start"  # beginning of the output: is it a <think>? (leading whitespace held until known)
    REASONING = "reasoning"  # inside <think>...</think>: text is reasoning
    CONTENT = "content"  # text is answer content
    CALL_NAME = "call_name"  # after <tool_call>: the function name, up to <arg_key>, </tool_call> or {
    CALL_JSON = "call_json"  # JSON-variant body, up to </tool_call>
    CALL_ARGS = "call_args"  # between argument pairs: whitespace, then <arg_key> or </tool_call>
    ARG_KEY = "arg_key"  # inside <arg_key>...</arg_key>
    ARG_GAP = "arg_gap"  # after </arg_key>: whitespace, then <arg_value>
    ARG_VALUE = "arg_value"  # inside <arg_value>...</arg_value>


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class _OpenCall:
    """A tool call whose ToolCallBegin is on the wire."""

    index: int
    properties: Mapping[str, Any]  # the tool's parameters.properties: schemas that type the values
    pairs_sent: int = 0  # argument pairs already on the wire (a separator goes before the next one)
    key: str = ""  # key of the pair in progress
    types: frozenset[str] | None = None  # JSON types the schema allows for that key (None: untyped)
    value: str = ""  # raw value text held until </arg_value> (values that are not streamed as strings)
    unsent: str = ""  # raw markup of the pair in progress not on the wire yet, returned as text on failure


class OutputParser:
    """Splits model output, arriving in arbitrary chunks, into events as soon as each is certain.

    Wire formats (special tokens arrive as their text)::

        <think>reasoning</think>content
        <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
        <tool_call>NAME</tool_call>                      (no arguments)
        <tool_call>NAME\\n{"k": "v"}</tool_call>          (JSON variant; also NAME>{...})

    Reasoning: with ``reasoning_open`` (the prompt ended with ``<think>``) the output starts inside the
    reasoning block; otherwise a ``<think>`` at the very start (after optional whitespace, which is dropped)
    opens it. Text after ``</think>`` is content; output that ends inside the block is all reasoning.
    ``<think>`` anywhere else and ``</think>`` outside reasoning are plain text.

    Tool calls (only when ``tools`` declares functions; otherwise the markup is plain text): whitespace
    around the name, between pairs and before ``</tool_call>`` is dropped. A call may appear inside the
    reasoning block; reasoning resumes after it. ``ToolCallBegin`` goes out once the name is complete and
    is a declared function, then ``ToolCallArguments`` fragments that concatenate to a JSON object (``{``,
    each ``"key": value`` comma separated, ``}``), then ``ToolCallEnd``. Values are typed by the tool's
    schema (see ``arguments.py``); string-only parameters stream piece by piece. A value ends at the first
    ``</arg_value>``, whatever it contains.

    Failures never raise and never lose text. Before ``ToolCallBegin`` (unknown name, bad name region,
    output ending inside the name) the ``<tool_call>`` marker and everything after it are read again as
    plain text of the surrounding section (reasoning inside ``<think>``, content otherwise). After it (text
    between pairs, a key without ``</arg_key>``, a JSON body that is not an object, output ending inside the
    call), the call is closed with the pairs already sent, a value in progress being completed with what
    arrived, and the unsent rest is read again as plain text of the surrounding section.

    With ``forced_call`` the output was made to be calls (a forced ``tool_choice``: the prompt ends inside the first
    one and a grammar holds the rest to calls), so one that ends inside a call was cut (``max_tokens``, a stop
    string): the call is closed with the pairs already sent as above (a complete name is a call with no arguments),
    and its unfinished markup is dropped rather than read as text, which would hand the client a fragment such as
    ``<arg_key>ci`` as the answer.

    Text that could still become a marker (``<``, ``<tool_``, ``</thi``) is held back until the next chunk
    or ``finish()``; everything else goes out at once.
    """

    def __init__(self, tools: list[dict] | None, reasoning_open: bool,
                 id_factory: Callable[[], str] | None = None, forced_call: bool = False) -> None:
        self._properties = tool_properties(tools)  # declared function name -> its parameter schemas
        self._forced_call = forced_call
        self._new_id = id_factory or new_call_id
        self._section = State.REASONING if reasoning_open else State.CONTENT  # where text outside calls goes
        self._state = State.REASONING if reasoning_open else State.START
        self._buffer = ""  # received text not yet emitted or consumed
        self._call: _OpenCall | None = None
        self._calls_begun = 0
        self._final = False  # finish() was called: nothing may wait for more text
        self._out: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        """Events made certain by one more chunk of output."""
        if self._final:
            raise RuntimeError("OutputParser.feed() called after finish()")
        self._buffer += text
        return self._run()

    def finish(self) -> list[Event]:
        """Everything still held back, at the end of the output; closes an unterminated call."""
        if self._final:
            return []
        self._final = True
        return self._run()

    def _run(self) -> list[Event]:
        while self._HANDLERS[self._state](self):
            pass
        out, self._out = self._out, []
        return out

    # Each handler works on the buffer in its state; it returns True to run again (state changed or text
    # consumed) and False when it needs more text.

    def _start(self) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(THINK_OPEN):
            self._buffer = head[len(THINK_OPEN):]
            self._section = self._state = State.REASONING
            return True
        if THINK_OPEN.startswith(head) and not self._final:
            return False
        self._state = State.CONTENT
        return True

    def _section_text(self) -> bool:
        markers = (CALL_OPEN,) if self._properties else ()
        if self._section is State.REASONING:
            markers += (THINK_CLOSE,)
        at, marker = _find_first(self._buffer, markers)
        if marker is None:
            self._emit_text(self._take(len(self._buffer) - self._held(markers)))
            return False
        self._emit_text(self._take(at))
        self._take(len(marker))
        if marker == THINK_CLOSE:
            self._section = self._state = State.CONTENT
        else:
            self._state = State.CALL_NAME
        return True

    def _call_name(self) -> bool:
        at, end = _find_first(self._buffer, (KEY_OPEN, CALL_CLOSE, JSON_BODY))
        if end is None:
            region = self._buffer[:len(self._buffer) - self._held((KEY_OPEN, CALL_CLOSE))]
            if self._cut_forced_call():
                return self._end_cut_call_at_its_name()
            if self._final or not self._name_viable(region):
                return self._reject_call()
            return False
        name = _clean_name(self._buffer[:at])
        if name not in self._properties:
            return self._reject_call()
        self._take(at)
        self._begin_call(name)
        if end == JSON_BODY:
            self._state = State.CALL_JSON
        elif end == KEY_OPEN:
            self._call.unsent = self._take(len(KEY_OPEN))
            self._state = State.ARG_KEY
        else:
            self._take(len(CALL_CLOSE))
            self._end_call()
        return True

    def _call_json(self) -> bool:
        at, end = _find_first(self._buffer, (CALL_CLOSE,))
        if end is None:
            return self._abort_call() if self._final else False
        arguments = decode_json(self._buffer[:at])
        if not isinstance(arguments, dict):
            return self._abort_call()
        self._take(at + len(CALL_CLOSE))
        for key, value in arguments.items():
            self._send(self._pair_prefix(key) + dump_json(value))
            self._call.pairs_sent += 1
        self._end_call()
        return True

    def _call_args(self) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(KEY_OPEN):
            self._call.unsent = self._take(len(self._buffer) - len(head) + len(KEY_OPEN))
            self._state = State.ARG_KEY
            return True
        if head.startswith(CALL_CLOSE):
            self._take(len(self._buffer) - len(head) + len(CALL_CLOSE))
            self._end_call()
            return True
        if self._final or not _could_start(head, (KEY_OPEN, CALL_CLOSE)):
            return self._abort_call()
        return False

    def _arg_key(self) -> bool:
        at, marker = _find_first(self._buffer, KEY_MARKERS)
        if marker != KEY_CLOSE:
            return self._abort_call() if marker is not None or self._final else False
        self._call.key = self._buffer[:at].strip()
        self._call.unsent += self._take(at + len(KEY_CLOSE))
        self._state = State.ARG_GAP
        return True

    def _arg_gap(self) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(VALUE_OPEN):
            self._call.unsent += self._take(len(self._buffer) - len(head) + len(VALUE_OPEN))
            self._open_value()
            return True
        if self._final or not _could_start(head, (VALUE_OPEN,)):
            return self._abort_call()
        return False

    def _arg_value(self) -> bool:
        at, end = _find_first(self._buffer, (VALUE_CLOSE,))
        if end is None and not self._final:
            self._add_value(self._take(len(self._buffer) - self._held((VALUE_CLOSE,))))
            return False
        # At the end of the output a value in progress is completed with what arrived (a forced call's less the start
        # of the closing marker it was cut in).
        if end is None and self._cut_forced_call():
            at -= _partial_marker_length(self._buffer, (VALUE_CLOSE,))
        self._add_value(self._take(at))
        if end is not None:
            self._take(len(VALUE_CLOSE))
        self._close_value()
        return True

    _HANDLERS: dict[State, Callable[[OutputParser], bool]] = {
        State.START: _start,
        State.REASONING: _section_text,
        State.CONTENT: _section_text,
        State.CALL_NAME: _call_name,
        State.CALL_JSON: _call_json,
        State.CALL_ARGS: _call_args,
        State.ARG_KEY: _arg_key,
        State.ARG_GAP: _arg_gap,
        State.ARG_VALUE: _arg_value,
    }

    def _name_viable(self, region: str) -> bool:
        """Could ``region`` (text after <tool_call> so far) still become a declared name? Deciding early
        keeps a literal "<tool_call>" in prose from holding back the text after it."""
        head = region.lstrip()
        name = _clean_name(head)
        if any(char.isspace() or char in "<>{" for char in name):
            return False
        if name != head:  # whitespace or '>' already followed the name: it is complete
            return name in self._properties
        return any(known.startswith(name) for known in self._properties)

    def _end_cut_call_at_its_name(self) -> bool:
        """A forced call cut after ``<tool_call>``: a call with no arguments if its name is complete, else nothing."""
        name = _clean_name(self._buffer[:len(self._buffer) - _partial_marker_length(self._buffer, (KEY_OPEN, CALL_CLOSE))])
        self._buffer = ""
        if name in self._properties:
            self._begin_call(name)
            self._end_call()
        self._state = self._section
        return True

    def _reject_call(self) -> bool:
        self._emit_text(CALL_OPEN)
        self._state = self._section
        return True

    def _begin_call(self, name: str) -> None:
        self._call = _OpenCall(index=self._calls_begun, properties=self._properties[name])
        self._calls_begun += 1
        self._out.append(ToolCallBegin(index=self._call.index, id=self._new_id(), name=name))
        self._send("{")

    def _end_call(self) -> None:
        self._send("}")
        self._out.append(ToolCallEnd(index=self._call.index))
        self._call = None
        self._state = self._section

    def _abort_call(self) -> bool:
        self._buffer = "" if self._cut_forced_call() else self._call.unsent + self._buffer
        self._end_call()
        return True

    def _cut_forced_call(self) -> bool:
        """The output ends inside a call it was made to be (see the class docstring)."""
        return self._forced_call and self._final

    def _open_value(self) -> None:
        call = self._call
        call.types = value_types(call.properties.get(call.key))
        if call.types == STRING_ONLY:
            self._send(self._pair_prefix(call.key) + '"')
            call.unsent = ""
        self._state = State.ARG_VALUE

    def _add_value(self, text: str) -> None:
        if self._call.types != STRING_ONLY:
            self._call.value += text
        elif text:
            self._send(json.dumps(text, ensure_ascii=False)[1:-1])  # escaping is per character: pieces concatenate

    def _close_value(self) -> None:
        call = self._call
        if call.types == STRING_ONLY:
            self._send('"')
        else:
            self._send(self._pair_prefix(call.key) + encode_value(call.value, call.types))
        call.pairs_sent += 1
        call.key, call.value, call.unsent = "", "", ""
        self._state = State.CALL_ARGS

    def _pair_prefix(self, key: str) -> str:
        separator = ", " if self._call.pairs_sent else ""
        return f"{separator}{json.dumps(key, ensure_ascii=False)}: "

    def _send(self, fragment: str) -> None:
        self._out.append(ToolCallArguments(index=self._call.index, fragment=fragment))

    def _emit_text(self, text: str) -> None:
        if text:
            kind = ReasoningText if self._section is State.REASONING else ContentText
            self._out.append(kind(text))

    def _take(self, size: int) -> str:
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def _held(self, markers: tuple[str, ...]) -> int:
        """How much of the buffer's end must wait: the longest end that could begin one of ``markers``."""
        return 0 if self._final else _partial_marker_length(self._buffer, markers)


def parse_output(text: str, tools: list[dict] | None, reasoning_open: bool,
                 id_factory: Callable[[], str] | None = None, forced_call: bool = False) -> ParsedOutput:
    """A whole output at once, through the same state machine as streaming (see ``OutputParser``)."""
    parser = OutputParser(tools, reasoning_open, id_factory, forced_call)
    return collect(parser.feed(text) + parser.finish())


def _clean_name(region: str) -> str:
    name = region.strip()
    return name[:-1].rstrip() if name.endswith(">") else name


def _find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """Position and identity of the earliest marker in ``text`` (no marker is a prefix of another)."""
    best, found = len(text), None
    for marker in markers:
        position = text.find(marker)
        if position != -1 and position < best:
            best, found = position, marker
    return best, found


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def _could_start(head: str, markers: tuple[str, ...]) -> bool:
    return any(marker.startswith(head) for marker in markers)
