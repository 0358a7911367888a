"""Wire types of the request bodies, validated at the boundary.

Types are strict (a string is not a number, a number is not a boolean) and ranges are checked here, so past
this module every value is known to be good. Unknown top-level fields are accepted (clients send many harmless
extras; ``server/unknown_fields.py`` logs and counts them); inside objects whose typos would silently change
behaviour (``sampling_params``, ``stream_options``, tool definitions' ``function``) unknown fields are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import FieldError

MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024
MAX_N = 16
MAX_TOP_LOGPROBS = 64
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limit

Temperature = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1)]
PositiveInt = Annotated[int, Field(ge=1)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]

class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Lenient(BaseModel):
    """Top-level bodies: unknown fields are accepted (``model_extra``)."""

    model_config = ConfigDict(strict=True, extra="allow")


def _stop_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


class SamplingFields(Lenient):
    """Sampling fields shared by the OpenAI endpoints (defaults are the OpenAI ones)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    max_tokens: PositiveInt | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value):
        if value:
            for key in value:
                if not key.strip().isdigit():
                    raise ValueError(f"keys must be token ids (decimal integers as strings), got {key!r}")
        return value

    def stop_strings(self) -> list[str]:
        return _stop_list(self.stop)


class StreamOptions(Strict):
    include_usage: bool = False


class ContentPart(Strict):
    type: str
    text: str | None = None
    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise FieldError("type", f"content parts of type {self.type!r} are not supported; only 'text' is")
        if self.text is None:
            raise FieldError("text", "a 'text' content part needs a 'text' string")
        return self


class FunctionCallIn(Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn
    index: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self):
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"a {self.role} message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise FieldError("tool_calls", "only assistant messages carry 'tool_calls'")
        return self


class FunctionDef(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value):
        if value is not None:
            kind = value.get("type", "object")
            if kind != "object":
                raise ValueError(f"must be a JSON schema of type 'object', got type {kind!r}")
            props = value.get("properties", {})
            if not isinstance(props, dict):
                raise ValueError("'properties' must be an object")
        return value


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoiceFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema; the wire name is kept by the alias
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's ``response_format``: the answer as free text, any JSON object, or JSON valid against a schema
    (held to it by constrained decoding, ``strict`` or not)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema', and allowed only with it")
        return self


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: PositiveInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "max"] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _cross_field_rules(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream is true")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            if not self.tools:
                raise FieldError("tool_choice", "'required' and a named function need 'tools'")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools}
            if self.tool_choice.function.name not in names:
                raise FieldError("tool_choice", f"names {self.tool_choice.function.name!r}, which is not in 'tools'")
        kwargs = self.chat_template_kwargs or {}
        if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
            raise FieldError("chat_template_kwargs.enable_thinking", "must be true or false")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: int | None = None
    user: str | None = None
    max_completion_tokens: PositiveInt | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _cross_field_rules(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream is true")
        if self.suffix:
            raise FieldError("suffix", "fill-in-the-middle is not supported")
        if self.logprobs is not None:
            raise FieldError("logprobs", "not supported on /v1/completions; use /generate with return_logprob")
        if self.best_of not in (None, 1):
            raise FieldError("best_of", "values other than 1 are not supported; use n")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class SGLangSamplingParams(Strict):
    max_new_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1024)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: Seed | None = None
    n: Literal[1] = 1
    # SGLang's constrained decoding: the output follows a JSON schema (as JSON text), a regex or a GBNF grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @model_validator(mode="after")
    def _one_grammar(self):
        given = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex and ebnf, got {' and '.join(given)}")
        return self

    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the requested grammar, None when there is none."""
        return next(((name, getattr(self, name)) for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None), None)


class GenerateRequest(Lenient):
    text: str | None = None
    input_ids: TokenIds | None = None
    sampling_params: SGLangSamplingParams = SGLangSamplingParams()
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: Annotated[int, Field(ge=-1)] = -1
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    token_ids_logprob: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=4096)] | None = None
    return_text_in_logprobs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise FieldError("text", "give exactly one of 'text' and 'input_ids'")
        return self


class TokenizeRequest(Lenient):
    text: str | list[str] | None = None
    prompt: str | list[str] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.prompt is None):
            raise FieldError("text", "give exactly one of 'text' and 'prompt'")
        return self


class DetokenizeRequest(Lenient):
    tokens: list[Annotated[int, Field(ge=0)]]
