"""Wire types of the Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as its official
clients send them, validated at the boundary like ``protocol.py``'s: strict types, ranges checked, unknown
top-level fields accepted and logged; content blocks accept the fields clients add (``cache_control``, ``citations``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .protocol import MAX_STOP_STRINGS, Lenient, PositiveInt, StopString, Strict, TopP

BLOCK_TYPES = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "thinking", "redacted_thinking", "tool_use"),
    "system": ("text",),
}
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "server_tool_use", "web_search_tool_result", "container_upload")


class Block(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextBlock(Block):
    type: Literal["text"]
    text: str


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        for i, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content[{i}] has type {kind!r}; tool results may hold text blocks only")
        return value


ContentBlock = TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data):
        """One clear error for a block this role cannot carry (the union's own errors list every member)."""
        if not isinstance(data, dict) or not isinstance(data.get("content"), list):
            return data
        allowed = BLOCK_TYPES.get(data.get("role"), ())
        for i, block in enumerate(data["content"]):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in UNSUPPORTED_BLOCKS:
                raise ValueError(f"content[{i}]: {kind} blocks are not supported (this model reads text only)")
            if allowed and kind not in allowed:
                raise ValueError(f"content[{i}] has type {kind!r}; a {data['role']} message carries {', '.join(allowed)} blocks")
        return data


class Tool(Block):
    """A client tool. Anthropic's own tool types (``web_search_*``, ``bash_*``, ...) run on its servers: refused."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    defer_loading: bool | None = None  # tool search: a deferred tool stays out of the prompt until found

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data):
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"tools of type {data['type']!r} are not supported; only client tools with an input_schema are")
        return data

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value):
        if value.get("type", "object") != "object":
            raise ValueError(f"must be a JSON schema of type 'object', got type {value.get('type')!r}")
        return value


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1024)]  # not enforced: GLM reasons until it is done
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(Strict):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class Metadata(Strict):
    user_id: str | None = None


class OutputConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    effort: Literal["low", "medium", "high", "max"] | None = None
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": ...}: goes to chat's response_format


class MessagesBase(Lenient):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None  # read for clear_thinking's keep: "all"

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, choice, info):
        tools = info.data.get("tools")  # validated before tool_choice (field order)
        if isinstance(choice, (ToolChoiceAny, ToolChoiceTool)) and not tools:
            raise ValueError(f"{choice.type!r} needs 'tools'")
        if isinstance(choice, ToolChoiceTool) and choice.name not in {t.name for t in tools}:
            raise ValueError(f"names {choice.name!r}, which is not in 'tools'")
        return choice

    def keeps_all_thinking(self) -> bool:
        """The client asked for every earlier turn's thinking to stay in context (a clear_thinking edit keeping all)."""
        edits = (self.context_management or {}).get("edits")
        return isinstance(edits, list) and any(
            isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking") and e.get("keep") == "all" for e in edits)


class MessagesRequest(MessagesBase):
    max_tokens: PositiveInt
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None


class CountTokensRequest(MessagesBase):
    pass
