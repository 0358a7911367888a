"""``POST /v1/responses``: the OpenAI Responses API (what Codex CLI speaks), stateless or with a bounded store.

A request's input items (messages, ``function_call``, ``function_call_output``, ``reasoning``) are translated into a
chat completions request (``to_chat``) and run as one ``agent_turn.Turn``; the answer's blocks come back as output
items (``reasoning``, ``message`` with ``output_text``, ``function_call``). Streamed, every event carries a
``sequence_number``: ``response.created``, ``response.in_progress``, then per item ``response.output_item.added``,
its content part and text deltas (``response.output_text.*``, ``response.reasoning_text.*``) or
``response.function_call_arguments.delta/done``, ``response.output_item.done``, and last ``response.completed``
(``response.incomplete`` at ``max_output_tokens``, ``response.failed`` when the engine fails); no ``[DONE]``.

``tool_choice`` ``required`` and named functions, and ``text.format``, become chat's ``tool_choice`` and
``response_format``; ``reasoning.effort`` the template's reasoning effort (``none`` turns reasoning off).
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from flask import Blueprint, current_app

from .agent_turn import Started, Turn, chat_request, seal_reasoning, unseal_reasoning
from .blocks import REASONING, TEXT, Block, BlockDelta, BlockStart, BlockStop
from .body import parse_body
from .errors import APIError
from .jobs import check_model, runtime
from .parsing import new_call_id
from .response_store import ResponseStore, StoreUnavailable, make_store
from .responses import engine_failure
from .responses_protocol import FunctionCallItem, FunctionCallOutputItem, MessageItem, NamedFunction, ReasoningItem, ResponsesRequest
from .sse import named_frame, stream_response

log = logging.getLogger(__name__)
bp = Blueprint("responses_api", __name__)

FIELDS = {"messages": "input", "tools": "tools", "tool_choice": "tool_choice", "max_tokens": "max_output_tokens",
          "response_format": "text.format", "reasoning_effort": "reasoning.effort"}
EFFORTS = {"xhigh": "max"}  # Responses efforts -> the chat template's; the others have the same names
_ignored_tools: set[str] = set()


@bp.record_once
def _make_store(state) -> None:
    settings = state.app.extensions["glm53"].settings
    state.app.extensions["glm53.responses"] = make_store(settings.responses_store, settings.responses_store_url)


def new_id(prefix: str) -> str:
    return prefix + "_" + secrets.token_hex(12)


@bp.post("/v1/responses")
def create_response():
    """The OpenAI Responses API. :raise 400: invalid body (naming the field), prompt over the context. :raise 404:
    unknown model, unknown previous_response_id. :raise 429: queue full. :raise 503: not ready, shared store down."""
    req = parse_body(ResponsesRequest)
    check_model(req.model)
    store: ResponseStore = current_app.extensions["glm53.responses"]
    history = [] if req.previous_response_id is None else _stored(store, req.previous_response_id)
    conversation = history + input_messages(req)
    turn = Turn(to_chat(req, conversation), new_call_id, CHAT_PARAMS)
    meta = {"id": new_id("resp"), "created_at": int(time.time()), "model": runtime().settings.served_name}
    keep = (store, conversation) if req.store is not False else None
    if req.stream:
        return stream_response(_stream(turn, req, meta, keep, runtime().settings.sse_keepalive_s))
    blocks, finish = turn.collect()
    items = [_item(b, _item_id(b), "completed", req) for b in blocks]
    if keep is not None:
        store.put(meta["id"], conversation + [_assistant(blocks)])
    return _response(meta, req, _status(finish), items, _usage(turn, finish, blocks))


def _stored(store: ResponseStore, response_id: str) -> list[dict]:
    try:
        history = store.conversation(response_id)
    except StoreUnavailable as e:
        raise APIError(503, f"the responses store is unavailable ({e}); retry", code="store_unavailable", headers={"Retry-After": "1"}) from e
    if history is None:
        raise APIError(404, f"previous_response_id: previous response with id {response_id!r} not found ({store.describe()})",
                       param="previous_response_id", code="previous_response_not_found")
    return history


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's input as chat messages; the reasoning, text and calls of one assistant turn (consecutive
    items) make one assistant message. ``instructions`` are not part of it (they do not carry over)."""
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    out: list[dict] = []
    turn: dict | None = None
    for i, item in enumerate(items):
        if isinstance(item, (ReasoningItem, FunctionCallItem)) or (isinstance(item, MessageItem) and item.role == "assistant"):
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            _add_to_turn(turn, item, i)
            continue
        turn = None
        if isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            out.append({"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)})
    return out


def _add_to_turn(turn: dict, item, index: int) -> None:
    if isinstance(item, ReasoningItem):
        text = "".join(p.text for p in item.content or []) or unseal_reasoning(item.encrypted_content) \
            or "".join(p.text for p in item.summary)
        if text:
            turn["reasoning_content"] = turn.get("reasoning_content", "") + text
    elif isinstance(item, FunctionCallItem):
        try:
            arguments = json.loads(item.arguments) if item.arguments.strip() else {}
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise APIError(400, f"input.{index}.arguments: must be a JSON object (as text)", param=f"input.{index}.arguments")
        turn.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}})
    else:
        turn["content"] = "\n\n".join(t for t in (turn["content"], _text(item.content)) if t)


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.value() for p in content)


def to_chat(req: ResponsesRequest, conversation: list[dict]):
    """The chat completions request that renders and samples like ``req``. :raise 400: naming the field."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict = {"messages": messages}
    for tool in req.tools or []:
        if tool.type != "function" and tool.type not in _ignored_tools:
            _ignored_tools.add(tool.type)
            log.info("ignoring %r tools on /v1/responses: they run on OpenAI's servers, not here", tool.type)
    functions = req.functions()
    if functions:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in functions]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    effort = req.reasoning.effort if req.reasoning is not None else None
    body["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    if effort not in (None, "none"):
        body["reasoning_effort"] = EFFORTS.get(effort, effort)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        body["response_format"] = _response_format(fmt)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    return chat_request(body, FIELDS)


# a chat field named in a 400 of the plan -> the Responses field it came from (text.format is flat: no json_schema level)
CHAT_PARAMS = ((r"response_format\.json_schema\.(.*)", r"text.format.\1"), (r"response_format(.*)", r"text.format\1"),
               (r"tools\[(\d+)\]\.function\.(.*)", r"tools[\1].\2"))


def _response_format(fmt) -> dict:
    """``text.format`` in chat's ``response_format`` shape."""
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {k: v for k, v in {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}.items() if v is not None}
    return {"type": "json_schema", "json_schema": schema}


def _item_id(block: Block) -> str:
    return new_id({REASONING: "rs", TEXT: "msg"}.get(block.kind, "fc"))


def _item(block: Block, item_id: str, status: str, req: ResponsesRequest) -> dict:
    """The output item of a block; in progress, with its content still empty."""
    done = status == "completed"
    if block.kind == REASONING:
        item = {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": block.text}] if done else [],
                "status": status}
        if done and "reasoning.encrypted_content" in (req.include or ()):
            item["encrypted_content"] = seal_reasoning(block.text)
        return item
    if block.kind == TEXT:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [_text_part(block.text)] if done else []}
    return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
            "arguments": block.text if done else "", "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _assistant(blocks: list[Block]) -> dict:
    """The answer as the chat message a later turn continues from (``previous_response_id``)."""
    message: dict = {"role": "assistant", "content": "\n\n".join(b.text for b in blocks if b.kind == TEXT)}
    reasoning = "".join(b.text for b in blocks if b.kind == REASONING)
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}} for b in blocks
             if b.kind not in (REASONING, TEXT)]
    if calls:
        message["tool_calls"] = calls
    return message


def _status(finish) -> str:
    return "incomplete" if finish.reason == "length" else "completed"


def _usage(turn: Turn, finish, blocks: list[Block]) -> dict:
    """OpenAI's Responses usage; reasoning tokens are counted by encoding the reasoning text again."""
    reasoning = "".join(b.text for b in blocks if b.kind == REASONING)
    reasoning_tokens = len(turn.tokenizer.encode(reasoning)) if reasoning else 0
    return {"input_tokens": turn.prompt_tokens, "input_tokens_details": {"cached_tokens": finish.cached_tokens},
            "output_tokens": finish.completion_tokens, "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, finish.completion_tokens)},
            "total_tokens": turn.prompt_tokens + finish.completion_tokens}


def _response(meta: dict, req: ResponsesRequest, status: str, output: list[dict], usage: dict | None, error: dict | None = None) -> dict:
    """The response object, as every event that carries one and the non-streamed answer show it."""
    return {
        **meta, "object": "response", "status": status, "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "service_tier": "default", "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}},
        "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice or "auto",
        "tools": [{**t.model_dump(exclude_none=True), "strict": t.strict} for t in req.functions()],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
        "usage": usage, "user": None, "metadata": req.metadata or {},
    }


class _Events:
    """Typed SSE events with the monotonic ``sequence_number`` every Responses event carries."""

    def __init__(self):
        self.seq = 0

    def __call__(self, kind: str, **fields) -> str:
        frame = named_frame(kind, {"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return frame


def _stream(turn: Turn, req: ResponsesRequest, meta: dict, keep, keepalive_s: float):
    event = _Events()
    ids: dict[int, str] = {}
    blocks: list[Block] = []
    items: list[dict] = []
    events = turn.events(keepalive_s)
    try:
        yield event("response.created", response=_response(meta, req, "in_progress", [], None))
        yield event("response.in_progress", response=_response(meta, req, "in_progress", [], None))
        for ev in events:
            if ev is None:
                yield ": keep-alive\n\n"
            elif isinstance(ev, Started):
                continue
            elif isinstance(ev, BlockStart):
                yield from _item_opened(event, ev.block, ids, blocks, req)
            elif isinstance(ev, BlockDelta):
                yield _text_delta(event, blocks[ev.index], ids[ev.index], ev.text)
            elif isinstance(ev, BlockStop):
                item = _item(ev.block, ids[ev.block.index], "completed", req)
                items.append(item)
                yield from _item_closed(event, ev.block, item)
            elif ev.reason in ("error", "cancelled"):
                err = engine_failure(ev)
                yield event("response.failed", response=_response(meta, req, "failed", items, None, {"code": "server_error", "message": err.message}))
            else:
                status = _status(ev)
                if keep is not None:
                    keep[0].put(meta["id"], keep[1] + [_assistant(blocks)])
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield event(kind, response=_response(meta, req, status, items, _usage(turn, ev, blocks)))
    finally:
        events.close()


def _item_opened(event: _Events, block: Block, ids: dict[int, str], blocks: list[Block], req: ResponsesRequest):
    item_id = ids[block.index] = _item_id(block)
    blocks.append(block)
    yield event("response.output_item.added", output_index=block.index, item=_item(block, item_id, "in_progress", req))
    if block.kind == TEXT:
        yield event("response.content_part.added", item_id=item_id, output_index=block.index, content_index=0, part=_text_part(""))
    elif block.kind == REASONING:
        yield event("response.content_part.added", item_id=item_id, output_index=block.index, content_index=0,
                    part={"type": "reasoning_text", "text": ""})


def _text_delta(event: _Events, block: Block, item_id: str, text: str) -> str:
    where = {"item_id": item_id, "output_index": block.index}
    if block.kind == TEXT:
        return event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
    if block.kind == REASONING:
        return event("response.reasoning_text.delta", **where, content_index=0, delta=text)
    return event("response.function_call_arguments.delta", **where, delta=text)


def _item_closed(event: _Events, block: Block, item: dict):
    where = {"item_id": item["id"], "output_index": block.index}
    if block.kind == TEXT:
        yield event("response.output_text.done", **where, content_index=0, text=block.text, logprobs=[])
        yield event("response.content_part.done", **where, content_index=0, part=_text_part(block.text))
    elif block.kind == REASONING:
        yield event("response.reasoning_text.done", **where, content_index=0, text=block.text)
        yield event("response.content_part.done", **where, content_index=0, part={"type": "reasoning_text", "text": block.text})
    else:
        yield event("response.function_call_arguments.done", **where, name=block.name, arguments=block.text)
    yield event("response.output_item.done", output_index=block.index, item=item)
