"""Wire types of the OpenAI Responses API (``POST /v1/responses``) as the official clients and Codex CLI send them,
validated at the boundary like ``protocol.py``'s. Input items and content parts accept the fields clients echo
back (``id``, ``status``, ``annotations``); an item type this server cannot read is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .protocol import Lenient, PositiveInt, Strict, Temperature, TopP

INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
# Tools other than functions (web_search, file_search, namespace, ...) run on OpenAI's side; they are left out of
# the prompt (and logged), so that a client that always offers them (Codex offers web_search) still works.
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(Item):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _text_parts(value):
    for i, part in enumerate(value if isinstance(value, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ValueError(f"content[{i}] has type {kind!r}; only text parts are supported (this model reads text only)")
    return value


class MessageItem(Item):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        return _text_parts(value)


class FunctionCallItem(Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, value):
        return _text_parts(value)


class SummaryText(Item):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Item):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Item):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(Item):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class HostedTool(Item):
    type: str

    @field_validator("type")
    @classmethod
    def _not_function(cls, value):
        if value == "function":
            raise ValueError("a function tool needs a 'name'")
        return value


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool | HostedTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None  # null is false: routers (SGLang's) send it so
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value):
        for i, item in enumerate(value if isinstance(value, list) else []):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind not in INPUT_ITEMS:
                raise ValueError(f"item {i} has type {kind!r}; supported input items: {', '.join(INPUT_ITEMS)}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_functions(cls, choice, info):
        functions = {t.name for t in info.data.get("tools") or [] if isinstance(t, FunctionTool)}  # tools come first
        if isinstance(choice, NamedFunction) and choice.name not in functions:
            raise ValueError(f"names {choice.name!r}, which is not a function in 'tools'")
        if choice == "required" and not functions:
            raise ValueError("'required' needs function tools")
        return choice

    @field_validator("background")
    @classmethod
    def _foreground(cls, value):
        if value:
            raise ValueError("background responses are not supported; stream instead")
        return value

    def functions(self) -> list[FunctionTool]:
        return [t for t in self.tools or [] if isinstance(t, FunctionTool)]
