"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: the Anthropic Messages API (what Claude Code speaks).

A request is translated into a chat completions request (``to_chat``) and runs as one ``agent_turn.Turn``; the
answer's blocks come back as Anthropic content blocks (``thinking``, ``text``, ``tool_use``), streamed as its event
sequence: ``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``thinking_delta``, ``input_json_delta``, ``signature_delta``) / ``content_block_stop``, then ``message_delta`` and
``message_stop``. Errors, on these paths, take Anthropic's shape (``{"type": "error", "error": {type, message}}``).

``tool_choice`` ``any`` and ``tool`` become chat's ``required`` and named choice, ``thinking`` becomes the
template's ``enable_thinking``, ``output_config.effort`` its reasoning effort, and a ``clear_thinking`` edit that
keeps all thinking its ``clear_thinking: false`` (every earlier turn is rendered as it was generated, so its
cached tokens are reused).
"""

from __future__ import annotations

import json
import secrets

from flask import Blueprint

from . import errors
from .agent_turn import Started, Turn, chat_request, seal_reasoning, unseal_reasoning
from .anthropic_protocol import (
    CountTokensRequest,
    MessagesBase,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from .blocks import REASONING, TEXT, Block, BlockDelta, BlockStart, BlockStop
from .body import parse_body
from .chat import plan_chat
from .errors import APIError
from .jobs import check_model, runtime
from .responses import engine_failure
from .sse import named_frame, stream_response

bp = Blueprint("anthropic", __name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
# where a chat completions field came from, to name it in an error
FIELDS = {"messages": "messages", "tools": "tools", "tool_choice": "tool_choice", "stop": "stop_sequences",
          "max_tokens": "max_tokens", "response_format": "output_config.format", "reasoning_effort": "output_config.effort"}


# a chat field named in a 400 of the plan -> the Anthropic field it came from
CHAT_PARAMS = ((r"response_format\.json_schema\.(.*)", r"output_config.format.\1"), (r"response_format(.*)", r"output_config.format\1"),
               (r"tools\[(\d+)\]\.function\.parameters(.*)", r"tools[\1].input_schema\2"))


def _response_format(fmt: dict) -> dict:
    """``output_config.format`` (``{"type": "json_schema", "schema": ...}``) in chat's ``response_format`` shape; any
    other shape goes through as it is, for chat's validation to name."""
    if fmt.get("type") == "json_schema" and "schema" in fmt:
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return fmt


def error_body(err: APIError) -> dict:
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


errors.use_shape("/v1/messages", error_body)


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


@bp.post("/v1/messages")
def messages():
    """The Anthropic Messages API. :raise 400: invalid body (naming the field), prompt over the context.
    :raise 401: no valid key. :raise 404: unknown model. :raise 429: queue full. :raise 503: not ready."""
    req = parse_body(MessagesRequest)
    check_model(req.model)
    turn = Turn(to_chat(req), new_tool_use_id, CHAT_PARAMS)
    meta = {"id": new_message_id(), "model": runtime().settings.served_name}
    show_thinking = getattr(req.thinking, "display", None) != "omitted"
    if req.stream:
        return stream_response(_stream(turn, req, meta, show_thinking, runtime().settings.sse_keepalive_s))
    blocks, finish = turn.collect()
    body = {**meta, "type": "message", "role": "assistant", "content": [_block(b, show_thinking) for b in blocks]}
    body.update(_stop(finish, blocks, req))
    body["usage"] = _usage(turn.prompt_tokens, finish.cached_tokens, finish.completion_tokens)
    return body


@bp.post("/v1/messages/count_tokens")
def count_tokens():
    """Prompt tokens of a Messages request (its system prompt, messages and tools as the model reads them)."""
    req = parse_body(CountTokensRequest)
    check_model(req.model)
    return {"input_tokens": len(plan_chat(to_chat(req)).prompt_ids)}


def to_chat(req: MessagesBase):
    """The chat completions request that renders and samples like ``req``. :raise 400: naming the field."""
    messages = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        messages += _chat_messages(m)
    body: dict = {"messages": messages}
    tools = [t for t in req.tools or [] if not t.defer_loading]
    if tools:
        body["tools"] = [{"type": "function", "function": _function(t)} for t in tools]
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceAny):
        body["tool_choice"] = "required"
    elif isinstance(choice, ToolChoiceTool):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, ToolChoiceNone):
        body["tool_choice"] = "none"
    if choice is not None and getattr(choice, "disable_parallel_tool_use", None):
        body["parallel_tool_calls"] = False
    thinking = req.thinking is not None and req.thinking.type != "disabled"
    kwargs: dict = {"enable_thinking": thinking}
    if req.keeps_all_thinking():
        kwargs["clear_thinking"] = False
    body["chat_template_kwargs"] = kwargs
    config = req.output_config
    if thinking and config is not None and config.effort is not None:
        body["reasoning_effort"] = config.effort
    if config is not None and config.format is not None:
        body["response_format"] = _response_format(config.format)
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    return chat_request(body, FIELDS)


def _function(tool) -> dict:
    fn = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        fn["description"] = tool.description
    return fn


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n\n".join(b.text for b in content)


def _chat_messages(m) -> list[dict]:
    """One Anthropic message as chat messages: a user message's tool results become tool messages (in order)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        return [_assistant(m.content)]
    out: list[dict] = []
    texts: list[str] = []
    for block in m.content:
        if isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": m.role, "content": "\n\n".join(texts)})
                texts = []
            content = block.content if isinstance(block.content, str) else _text(block.content or [])
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            texts.append(block.text)
    if texts:
        out.append({"role": m.role, "content": "\n\n".join(texts)})
    return out


def _assistant(blocks: list) -> dict:
    reasoning = [b.thinking or unseal_reasoning(b.signature) or "" for b in blocks if isinstance(b, ThinkingBlock)]
    message: dict = {"role": "assistant", "content": "\n\n".join(b.text for b in blocks if isinstance(b, TextBlock))}
    if any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}} for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        message["tool_calls"] = calls
    return message


def _block(block: Block, show_thinking: bool) -> dict:
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": block.text if show_thinking else "", "signature": seal_reasoning(block.text)}
    if block.kind == TEXT:
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": json.loads(block.text)}


def _start_block(block: Block) -> dict:
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": "", "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}


def _delta(block: Block, text: str) -> dict:
    if block.kind == REASONING:
        return {"type": "thinking_delta", "thinking": text}
    if block.kind == TEXT:
        return {"type": "text_delta", "text": text}
    return {"type": "input_json_delta", "partial_json": text}


def _stop(finish, blocks: list[Block], req: MessagesRequest) -> dict:
    """``stop_reason`` and ``stop_sequence`` of a finished answer."""
    if finish.reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if any(b.kind not in (REASONING, TEXT) for b in blocks):
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(finish.matched, str) and finish.matched in (req.stop_sequences or ()):
        return {"stop_reason": "stop_sequence", "stop_sequence": finish.matched}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    """Anthropic counts the prompt in parts: ``input_tokens`` are the ones not read from the cache."""
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": output_tokens}


def _stream(turn: Turn, req: MessagesRequest, meta: dict, show_thinking: bool, keepalive_s: float):
    """The event stream; ``message_start`` waits for the prompt's prefill, so that its usage is the real one
    (SSE comments keep the connection alive meanwhile, ``ping`` events after it)."""
    blocks: list[Block] = []
    started = False
    events = turn.events(keepalive_s)
    try:
        for ev in events:
            if ev is None:
                yield named_frame("ping", {"type": "ping"}) if started else ": keep-alive\n\n"
            elif isinstance(ev, Started):
                started = True
                message = {**meta, "type": "message", "role": "assistant", "content": [], "stop_reason": None, "stop_sequence": None,
                           "usage": _usage(turn.prompt_tokens, ev.cached_tokens, 0)}
                yield named_frame("message_start", {"type": "message_start", "message": message})
                yield named_frame("ping", {"type": "ping"})
            elif isinstance(ev, BlockStart):
                blocks.append(ev.block)
                yield named_frame("content_block_start", {"type": "content_block_start", "index": ev.block.index,
                                                          "content_block": _start_block(ev.block)})
            elif isinstance(ev, BlockDelta):
                block = blocks[ev.index]
                if block.kind != REASONING or show_thinking:
                    yield named_frame("content_block_delta", {"type": "content_block_delta", "index": ev.index, "delta": _delta(block, ev.text)})
            elif isinstance(ev, BlockStop):
                if ev.block.kind == REASONING:
                    signature = {"type": "signature_delta", "signature": seal_reasoning(ev.block.text)}
                    yield named_frame("content_block_delta", {"type": "content_block_delta", "index": ev.block.index, "delta": signature})
                yield named_frame("content_block_stop", {"type": "content_block_stop", "index": ev.block.index})
            elif ev.reason in ("error", "cancelled"):
                yield named_frame("error", error_body(engine_failure(ev)))
            else:
                delta = {"type": "message_delta", "delta": _stop(ev, blocks, req),
                         "usage": _usage(turn.prompt_tokens, ev.cached_tokens, ev.completion_tokens)}
                yield named_frame("message_delta", delta)
                yield named_frame("message_stop", {"type": "message_stop"})
    finally:
        events.close()

