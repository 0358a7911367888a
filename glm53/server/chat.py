"""``POST /v1/chat/completions``: messages → prompt (chat template) → jobs → reasoning, content and tool calls.

Streamed and non-streamed answers go through the same output parser (``parsing``), so they carry the same
reasoning, content and tool calls. ``tool_choice`` ``required`` or a named function starts the assistant turn
with the tool call (``<tool_call>`` or ``<tool_call>NAME``) after an empty reasoning block, and a grammar holds
the call to the tool's schema; ``response_format`` and strict tools are held to theirs too (``structured.py``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from functools import partial

from flask import Blueprint, request

from ..engine.constraints import CompiledGrammar
from ..engine.interface import Delta, Finish, GenerationRequest, LogprobRequest
from ..models.chat_template import TemplateError
from .body import parse_body
from .errors import APIError
from .jobs import JobGroup, check_model, max_new_tokens, runtime, sampling_params
from .logprobs import chat_logprobs
from .parsing import ContentText, OutputParser, ReasoningText, ToolCallArguments, ToolCallBegin, parse_output
from .protocol import ChatCompletionRequest
from .responses import cached_prompt_tokens, engine_failure, finish_reason, usage
from .sse import DONE, frame, stream_response
from .structured import call_prefix, compile_structure, from_openai

bp = Blueprint("chat", __name__)

RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "enable_thinking"})


@dataclass(frozen=True)
class ChatPlan:
    prompt_ids: list[int]
    tools: list[dict] | None  # tools whose calls the output parser recognises (None: tool markup is text)
    reasoning_open: bool  # the prompt ends inside a reasoning block
    prefix: str  # text the assistant turn was started with (a forced tool call), parsed as if generated
    grammar: CompiledGrammar | None  # what every choice is held to (None: free)


@bp.post("/v1/chat/completions")
def chat_completions():
    """:raise 400: invalid body, unknown template kwargs, prompt over the context. :raise 404: unknown model.
    :raise 429: queue full. :raise 503: model not ready."""
    req = parse_body(ChatCompletionRequest)
    check_model(req.model)
    plan = plan_chat(req)
    group = JobGroup(generation_requests(req, plan), request.environ)
    meta = {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()), "model": runtime().settings.served_name}
    # (token ids, their TokenLogprobs) -> the choice's "logprobs"; None when they were not asked for
    logprobs = partial(chat_logprobs, runtime().backend.tokenizer) if req.logprobs else None
    if req.stream:
        return stream_response(_stream(group, plan, req, meta, runtime().settings.sse_keepalive_s, logprobs))
    return _collect(group, plan, req, meta, logprobs)


def generation_requests(req: ChatCompletionRequest, plan: ChatPlan) -> list[GenerationRequest]:
    """The scheduler jobs of a planned request, one per choice (also those of /v1/messages and /v1/responses,
    which arrive here translated into a chat request). :raise 400: the prompt leaves no room in the context."""
    budget = max_new_tokens(req.requested_max_tokens(), len(plan.prompt_ids))
    return [
        GenerationRequest(
            prompt_ids=tuple(plan.prompt_ids),
            max_new_tokens=budget,
            sampling=sampling_params(req, choice),
            stop_strings=tuple(req.stop_strings()),
            ignore_eos=req.ignore_eos,
            logprobs=LogprobRequest(top_n=req.top_logprobs or 0) if req.logprobs else None,
            grammar=plan.grammar,
        )
        for choice in range(req.n)
    ]


def plan_chat(req: ChatCompletionRequest) -> ChatPlan:
    rt = runtime()
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys() - {"enable_thinking"})
    if clash:
        raise APIError(400, f"chat_template_kwargs.{clash[0]} is set by the server and cannot be passed", param="chat_template_kwargs")
    enable_thinking = kwargs.pop("enable_thinking", req.reasoning_effort != "none")
    if req.reasoning_effort not in (None, "none"):
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    structure = from_openai(req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls)
    prefix = call_prefix(structure)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        rendered = rt.template().render(messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking and not prefix, **kwargs)
    except TemplateError as exc:
        raise APIError(400, str(exc), param="messages", code="template_error") from None
    ids = rt.backend.tokenizer.encode(rendered.text + prefix)
    reasoning_open = rendered.thinking_open and not prefix
    grammar = compile_structure(structure, rt.backend.vocabulary, reasoning_open)
    return ChatPlan(ids, tools, reasoning_open, prefix, grammar)


def _deltas(events: list) -> list[dict]:
    """Parser events → chat deltas; consecutive texts of one kind share a delta."""
    out: list[dict] = []
    for ev in events:
        if isinstance(ev, (ReasoningText, ContentText)):
            key = "reasoning_content" if isinstance(ev, ReasoningText) else "content"
            if out and list(out[-1]) == [key]:
                out[-1][key] += ev.text
            elif ev.text:
                out.append({key: ev.text})
        elif isinstance(ev, ToolCallBegin):
            fn = {"name": ev.name, "arguments": ""}
            out.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function", "function": fn}]})
        elif isinstance(ev, ToolCallArguments):
            out.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
    return out


def _stream(group: JobGroup, plan: ChatPlan, req: ChatCompletionRequest, meta: dict, keepalive_s: float, logprobs):
    """The SSE body; runs after the view returned (outside the app context), so it gets what it needs. A step's
    token logprobs ride on the last chunk made from that step (on an empty delta when its text is held back)."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    parsers = [OutputParser(plan.tools, plan.reasoning_open, forced_call=bool(plan.prefix)) for _ in range(req.n)]
    called = [False] * req.n
    finishes: list[Finish | None] = [None] * req.n

    def chunk(index: int, delta: dict, finish: str | None = None, lps: dict | None = None) -> str:
        body = {**meta, "object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return frame(body)

    try:
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
            for delta in _deltas(parsers[i].feed(plan.prefix)):
                yield chunk(i, delta)
        for item in group.sse_events(keepalive_s):
            if isinstance(item, str):
                yield item
                continue
            i, ev = item
            if isinstance(ev, Delta):
                events = parsers[i].feed(ev.text)
            else:
                finishes[i] = ev
                events = parsers[i].finish()
            called[i] = called[i] or any(isinstance(e, ToolCallBegin) for e in events)
            deltas = _deltas(events)
            lps = logprobs(ev.token_ids, ev.logprobs) if logprobs and isinstance(ev, Delta) and ev.token_ids else None
            if lps and not deltas:
                deltas = [{}]
            for n, delta in enumerate(deltas, start=1):
                yield chunk(i, delta, lps=lps if n == len(deltas) else None)
            if isinstance(ev, Finish):
                yield chunk(i, {}, finish_reason(ev, called[i]))
        if include_usage and not group.failed:
            body = usage(len(plan.prompt_ids), sum(f.completion_tokens for f in finishes), cached_prompt_tokens(finishes, req.n))
            yield frame({**meta, "object": "chat.completion.chunk", "choices": [], "usage": body})
        yield DONE
    finally:
        group.close()


def _collect(group: JobGroup, plan: ChatPlan, req: ChatCompletionRequest, meta: dict, logprobs):
    texts = [[plan.prefix] for _ in range(req.n)]
    tokens = [([], []) for _ in range(req.n)]  # per choice: token ids and their TokenLogprobs
    finishes: list[Finish | None] = [None] * req.n
    try:
        for item in group.events(None):
            i, ev = item
            if isinstance(ev, Delta):
                texts[i].append(ev.text)
                tokens[i][0].extend(ev.token_ids)
                tokens[i][1].extend(ev.logprobs or ())
            else:
                finishes[i] = ev
    finally:
        group.close()
    choices = []
    for i, fin in enumerate(finishes):
        if fin.reason in ("error", "cancelled"):
            raise engine_failure(fin)
        parsed = parse_output("".join(texts[i]), plan.tools, plan.reasoning_open, forced_call=bool(plan.prefix))
        message = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning}
        if parsed.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
            ]
        lps = logprobs(*tokens[i]) if logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lps, "finish_reason": finish_reason(fin, bool(parsed.tool_calls))})
    completion = sum(f.completion_tokens for f in finishes)
    return {**meta, "object": "chat.completion", "choices": choices,
            "usage": usage(len(plan.prompt_ids), completion, cached_prompt_tokens(finishes, req.n))}
