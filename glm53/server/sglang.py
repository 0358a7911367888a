"""SGLang-shaped endpoints: ``POST /generate`` (generation and teacher-forced scoring), ``/tokenize``,
``/detokenize``. The quality tools (``bench/score_ref_panel.py``) speak this dialect, so the same scorer works
against SGLang servers.

``sampling_params.json_schema`` (JSON text), ``regex`` or ``ebnf`` (GBNF) hold the output to that grammar
(``structured.py``); it ends where the grammar does.

Log-probability entries are ``[logprob, token_id, text]`` triples (text only with ``return_text_in_logprobs``).
Input entry j belongs to position ``logprob_start_len + j`` and holds the distribution that predicted that
token; position 0 has no prediction (``null``).
"""

from __future__ import annotations

import time
import uuid

from flask import Blueprint, request

from ..engine.interface import Delta, Finish, GenerationRequest, LogprobRequest, SamplingParams, Scored, ScoreRequest, TokenLogprobs
from .body import parse_body
from .errors import APIError
from .jobs import JobGroup, check_token_ids, max_new_tokens, runtime, top_k
from .protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest
from .responses import engine_failure
from .sse import DONE, frame, stream_response
from .structured import compile_request_grammar

bp = Blueprint("sglang", __name__)


@bp.post("/generate")
def generate():
    """:raise 400: invalid body, token ids outside the vocabulary, prompt over the context, bad logprob_start_len,
    input logprobs for more tokens than one scoring forward takes.
    :raise 429: queue full. :raise 503: model not ready."""
    req = parse_body(GenerateRequest)
    tokenizer = runtime().backend.tokenizer
    ids = list(req.input_ids) if req.input_ids is not None else tokenizer.encode(req.text)
    if req.input_ids is not None:
        check_token_ids(ids, "input_ids")
    sp = req.sampling_params
    budget = max_new_tokens(sp.max_new_tokens, len(ids), param="input_ids") if sp.max_new_tokens != 0 else 0
    lp = None
    if req.return_logprob:
        check_token_ids(req.token_ids_logprob or [], "token_ids_logprob")
        lp = LogprobRequest(top_n=req.top_logprobs_num, token_ids=tuple(req.token_ids_logprob or ()))
    jobs: list = []
    if budget:
        sampling = SamplingParams(
            temperature=sp.temperature, top_k=top_k(sp.top_k), top_p=sp.top_p, min_p=sp.min_p,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty, seed=sp.sampling_seed,
        )
        check_token_ids(sp.stop_token_ids or [], "sampling_params.stop_token_ids")
        stops = [sp.stop] if isinstance(sp.stop, str) else (sp.stop or [])
        wanted = sp.grammar()
        grammar = compile_request_grammar(*wanted, runtime().backend.vocabulary, f"sampling_params.{wanted[0]}") if wanted else None
        jobs.append(GenerationRequest(tuple(ids), budget, sampling, tuple(stops), frozenset(sp.stop_token_ids or ()), sp.ignore_eos,
                                      sp.skip_special_tokens, lp, grammar))
    if req.return_logprob and req.logprob_start_len >= 0:
        if req.logprob_start_len >= len(ids):
            raise APIError(400, f"logprob_start_len ({req.logprob_start_len}) must be below the input length ({len(ids)})", param="logprob_start_len")
        limit = runtime().backend.info.max_score_tokens
        if limit is not None and len(ids) > limit:
            raise APIError(400, f"input logprobs are computed for at most {limit} tokens at once (the prefill chunk); "
                                f"this input has {len(ids)}: score it in pieces", param="input_ids" if req.input_ids is not None else "text")
        jobs.append(ScoreRequest(tuple(ids), req.logprob_start_len, lp))
    if not jobs:
        raise APIError(400, "nothing to do: max_new_tokens is 0 and no input logprobs were asked for", param="sampling_params.max_new_tokens")
    out = _Output(ids, req, tokenizer)
    group = JobGroup(jobs, request.environ)
    if req.stream:
        return stream_response(_stream(group, out, runtime().settings.sse_keepalive_s))
    return _collect(group, out)


class _Output:
    """The response under construction: text and ids so far, logprobs, finish."""

    def __init__(self, ids: list[int], req: GenerateRequest, tokenizer):
        self.rid = uuid.uuid4().hex
        self.t0 = time.monotonic()
        self.prompt_ids = ids
        self.req = req
        self.tokenizer = tokenizer
        self.text = ""
        self.output_ids: list[int] = []
        self.output_lps: list[TokenLogprobs] = []
        self.cached_tokens = 0  # prompt tokens served from the prefix cache, known from the first token on
        self.scored: list | None = None
        self.finish: Finish | None = None

    def add(self, ev: Delta) -> None:
        self.text += ev.text
        self.output_ids.extend(ev.token_ids)
        self.output_lps.extend(ev.logprobs or ())
        if ev.cached_tokens is not None:
            self.cached_tokens = ev.cached_tokens

    def body(self) -> dict:
        meta = {
            "id": self.rid,
            "finish_reason": _finish(self.finish) if self.finish else None,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(time.monotonic() - self.t0, 4),
        }
        if self.req.return_logprob and (self.finish or not self.req.stream):
            meta.update(self._logprobs())
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}

    def _logprobs(self) -> dict:
        req = self.req
        triple = self._triple
        out: dict = {}
        if self.scored is not None:
            positions = range(req.logprob_start_len, len(self.prompt_ids))
            out["input_token_logprobs"] = [[e.logprob if e else None, self.prompt_ids[p], self._text(self.prompt_ids[p])] for p, e in zip(positions, self.scored)]
            out["input_top_logprobs"] = [[triple(t, v) for t, v in e.top] if e else None for e in self.scored]
            if req.token_ids_logprob:
                out["input_token_ids_logprobs"] = [[triple(t, v) for t, v in e.requested] if e else None for e in self.scored]
        out["output_token_logprobs"] = [triple(t, e.logprob) for t, e in zip(self.output_ids, self.output_lps)]
        out["output_top_logprobs"] = [[triple(t, v) for t, v in e.top] for e in self.output_lps]
        if req.token_ids_logprob:
            out["output_token_ids_logprobs"] = [[triple(t, v) for t, v in e.requested] for e in self.output_lps]
        return out

    def _triple(self, token_id: int, logprob: float) -> list:
        return [logprob, token_id, self._text(token_id)]

    def _text(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.req.return_text_in_logprobs else None


def _finish(fin: Finish) -> dict:
    if fin.reason == "stop":
        return {"type": "stop", "matched": fin.matched}
    if fin.reason == "length":
        return {"type": "length", "length": fin.completion_tokens}
    return {"type": "abort", "message": fin.error or fin.reason}


def _apply(out: _Output, ev: object) -> None:
    if isinstance(ev, Delta):
        out.add(ev)
    elif isinstance(ev, Scored):
        out.scored = ev.entries
    elif isinstance(ev, Finish):
        out.finish = ev


def _stream(group: JobGroup, out: _Output, keepalive_s: float):
    try:
        for item in group.sse_events(keepalive_s):
            if isinstance(item, str):
                yield item
                continue
            _, ev = item
            _apply(out, ev)
            if isinstance(ev, Delta) and ev.token_ids:
                yield frame(out.body())
        if not group.failed:
            if out.finish is None:  # scoring only
                out.finish = Finish("length", len(out.prompt_ids), 0)
            yield frame(out.body())
        yield DONE
    finally:
        group.close()


def _collect(group: JobGroup, out: _Output):
    try:
        for _, ev in group.events(None):
            if isinstance(ev, Finish) and ev.reason in ("error", "cancelled"):
                raise engine_failure(ev)
            _apply(out, ev)
    finally:
        group.close()
    if out.finish is None:
        out.finish = Finish("length", len(out.prompt_ids), 0)
    return out.body()


@bp.post("/tokenize")
def tokenize():
    req = parse_body(TokenizeRequest)
    backend = runtime().backend
    text = req.text if req.text is not None else req.prompt
    if isinstance(text, str):
        ids = backend.tokenizer.encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": backend.info.context_length}
    ids = [backend.tokenizer.encode(t) for t in text]
    return {"tokens": ids, "count": [len(i) for i in ids], "max_model_len": backend.info.context_length}


@bp.post("/detokenize")
def detokenize():
    req = parse_body(DetokenizeRequest)
    check_token_ids(req.tokens, "tokens")
    return {"text": runtime().backend.tokenizer.decode(req.tokens)}
