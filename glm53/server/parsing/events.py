"""What the output parser emits, and the aggregate a non-streamed response is built from."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReasoningText:
    text: str


@dataclass(frozen=True)
class ContentText:
    text: str


@dataclass(frozen=True)
class ToolCallBegin:
    index: int  # position among this response's tool calls, 0-based (OpenAI `tool_calls[].index`)
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    fragment: str  # the fragments of one call concatenate to a JSON object


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = ReasoningText | ContentText | ToolCallBegin | ToolCallArguments | ToolCallEnd


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI `function.arguments`)


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None  # None when there was no reasoning text (or only whitespace)
    content: str | None  # None when empty or whitespace only (OpenAI `message.content: null`)
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def collect(events: Iterable[Event]) -> ParsedOutput:
    """Aggregate a whole response's events: what a client that concatenates every delta ends up with."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ReasoningText):
            reasoning.append(event.text)
        elif isinstance(event, ContentText):
            content.append(event.text)
        elif isinstance(event, ToolCallBegin):
            calls[event.index] = (event.id, event.name)
            arguments[event.index] = []
        elif isinstance(event, ToolCallArguments):
            arguments[event.index].append(event.fragment)
    tool_calls = [ParsedToolCall(id=call_id, name=name, arguments="".join(arguments[index]))
                  for index, (call_id, name) in sorted(calls.items())]
    return ParsedOutput(reasoning=_text_or_none(reasoning), content=_text_or_none(content), tool_calls=tool_calls)


def _text_or_none(pieces: list[str]) -> str | None:
    text = "".join(pieces)
    return text if text.strip() else None
