"""``POST /v1/completions``: raw prompts (text or token ids, one or several) → text (held to ``response_format``'s
JSON schema from its first token when one is given)."""

from __future__ import annotations

import time
import uuid

from flask import Blueprint, request

from ..engine.interface import Delta, Finish, GenerationRequest
from .body import parse_body
from .jobs import JobGroup, check_model, check_token_ids, max_new_tokens, runtime, sampling_params
from .protocol import CompletionRequest
from .responses import cached_prompt_tokens, engine_failure, finish_reason, usage
from .sse import DONE, frame, stream_response
from .structured import compile_structure, from_openai

bp = Blueprint("completions", __name__)


@bp.post("/v1/completions")
def completions():
    """Choice ``p * n + c`` is the c-th sample of prompt p. :raise 400: invalid body or a prompt over the context.
    :raise 404: unknown model. :raise 429: queue full. :raise 503: model not ready."""
    req = parse_body(CompletionRequest)
    check_model(req.model)
    tokenizer = runtime().backend.tokenizer
    prompts: list[list[int]] = []
    for p in req.prompts():
        if isinstance(p, str):
            prompts.append(tokenizer.encode(p))
        else:
            check_token_ids(p, "prompt")
            prompts.append(list(p))
    grammar = compile_structure(from_openai(req.response_format, None, None, None), runtime().backend.vocabulary, reasoning_open=False)
    jobs = []
    for ids in prompts:
        budget = max_new_tokens(req.requested_max_tokens(), len(ids), param="prompt")
        for choice in range(req.n):
            jobs.append(
                GenerationRequest(
                    prompt_ids=tuple(ids),
                    max_new_tokens=budget,
                    sampling=sampling_params(req, choice),
                    stop_strings=tuple(req.stop_strings()),
                    ignore_eos=req.ignore_eos,
                    grammar=grammar,
                )
            )
    echoes = [tokenizer.decode(ids) if req.echo else "" for ids in prompts for _ in range(req.n)]
    prompt_tokens = sum(len(ids) for ids in prompts)
    group = JobGroup(jobs, request.environ)
    meta = {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()), "model": runtime().settings.served_name}
    if req.stream:
        return stream_response(_stream(group, req, meta, echoes, prompt_tokens, runtime().settings.sse_keepalive_s))
    return _collect(group, req, meta, echoes, prompt_tokens)


def _stream(group: JobGroup, req: CompletionRequest, meta: dict, echoes: list[str], prompt_tokens: int, keepalive_s: float):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    finishes: list[Finish | None] = [None] * len(echoes)

    def chunk(index: int, text: str, finish: str | None = None) -> str:
        body = {**meta, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return frame(body)

    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield chunk(i, echo)
        for item in group.sse_events(keepalive_s):
            if isinstance(item, str):
                yield item
                continue
            i, ev = item
            if isinstance(ev, Delta):
                if ev.text:
                    yield chunk(i, ev.text)
            else:
                finishes[i] = ev
                yield chunk(i, "", finish_reason(ev))
        if include_usage and not group.failed:
            body = usage(prompt_tokens, sum(f.completion_tokens for f in finishes), cached_prompt_tokens(finishes, req.n))
            yield frame({**meta, "choices": [], "usage": body})
        yield DONE
    finally:
        group.close()


def _collect(group: JobGroup, req: CompletionRequest, meta: dict, echoes: list[str], prompt_tokens: int):
    texts = [[echo] for echo in echoes]
    finishes: list[Finish | None] = [None] * len(echoes)
    try:
        for i, ev in group.events(None):
            if isinstance(ev, Delta):
                texts[i].append(ev.text)
            else:
                finishes[i] = ev
    finally:
        group.close()
    for fin in finishes:
        if fin.reason in ("error", "cancelled"):
            raise engine_failure(fin)
    choices = [
        {"index": i, "text": "".join(texts[i]), "logprobs": None, "finish_reason": finish_reason(fin)} for i, fin in enumerate(finishes)
    ]
    completion = sum(f.completion_tokens for f in finishes)
    return {**meta, "choices": choices, "usage": usage(prompt_tokens, completion, cached_prompt_tokens(finishes, req.n))}
