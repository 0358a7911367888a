"""The output parser's events grouped into content blocks: what Anthropic calls content blocks and the Responses
API output items (a reasoning block, a text block, a tool call), each opened, extended and closed in order.

A block of text or reasoning opens at its first non-whitespace character: whitespace between sections (the
``\\n\\n`` after ``</think>``, before a ``<tool_call>``) never becomes a block of its own, and a block's leading
whitespace is dropped, as the chat template drops it when the turn comes back as history. Streamed and
non-streamed answers run through the same grouping, so they carry the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .parsing import ContentText, Event, ReasoningText, ToolCallArguments, ToolCallBegin, ToolCallEnd

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"


@dataclass
class Block:
    index: int  # position among the answer's blocks
    kind: str  # REASONING, TEXT or TOOL_CALL
    text: str = ""  # the reasoning or text; for a tool call its arguments (a JSON object, as text)
    call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class BlockStart:
    block: Block  # its text grows with the deltas that follow: read only its kind, index and ids here


@dataclass(frozen=True)
class BlockDelta:
    index: int
    text: str


@dataclass(frozen=True)
class BlockStop:
    block: Block  # complete


BlockEvent = BlockStart | BlockDelta | BlockStop


class Blocks:
    """Turns parser events into block events; ``blocks`` holds every block opened so far."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._held = ""  # whitespace of a text or reasoning block not opened yet
        self._held_kind: str | None = None

    def feed(self, events: list[Event]) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        for ev in events:
            if isinstance(ev, (ReasoningText, ContentText)):
                self._text(REASONING if isinstance(ev, ReasoningText) else TEXT, ev.text, out)
            elif isinstance(ev, ToolCallBegin):
                self._drop_held()
                self._close(out)
                self._start(Block(len(self.blocks), TOOL_CALL, call_id=ev.id, name=ev.name), out)
            elif isinstance(ev, ToolCallArguments) and self._open is not None:
                self._extend(ev.fragment, out)
            elif isinstance(ev, ToolCallEnd):
                self._close(out)
        return out

    def close(self) -> list[BlockEvent]:
        """At the end of the answer: close the open block (held whitespace is dropped)."""
        out: list[BlockEvent] = []
        self._drop_held()
        self._close(out)
        return out

    def _text(self, kind: str, text: str, out: list[BlockEvent]) -> None:
        if self._open is not None and self._open.kind == kind:
            self._extend(text, out)
            return
        if self._held_kind != kind:
            self._held, self._held_kind = "", kind
        self._held += text
        start = len(self._held) - len(self._held.lstrip())
        if start == len(self._held):
            return
        text, self._held, self._held_kind = self._held[start:], "", None
        self._close(out)
        self._start(Block(len(self.blocks), kind), out)
        self._extend(text, out)

    def _start(self, block: Block, out: list[BlockEvent]) -> None:
        self.blocks.append(block)
        self._open = block
        out.append(BlockStart(block))

    def _extend(self, text: str, out: list[BlockEvent]) -> None:
        if text:
            self._open.text += text
            out.append(BlockDelta(self._open.index, text))

    def _close(self, out: list[BlockEvent]) -> None:
        if self._open is not None:
            out.append(BlockStop(self._open))
            self._open = None

    def _drop_held(self) -> None:
        self._held, self._held_kind = "", None
