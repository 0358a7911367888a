"""What every generating endpoint shares: the runtime handle, turning request fields into scheduler requests,
and :class:`JobGroup`, the jobs of one HTTP request (one per choice) with the channel their events arrive on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from flask import current_app

from ..config import Settings
from ..engine.interface import Backend, Delta, Finish, GenerationRequest, SamplingParams, Scored, ScoreRequest
from ..engine.scheduler import NotReady, QueueFull, Scheduler
from ..progress import Progress
from .access_log import current_record
from .bridge import make_channel
from .disconnect import DisconnectWatcher
from .drain import Drain
from .errors import APIError
from .metrics import Metrics
from .protocol import SamplingFields
from .responses import engine_failure
from .sse import KEEPALIVE, frame


@dataclass
class Runtime:
    """The server's long-lived objects, kept in ``app.extensions["glm53"]``."""

    settings: Settings
    scheduler: Scheduler
    metrics: Metrics
    drain: Drain = field(default_factory=Drain)
    progress: Progress = field(default_factory=Progress)  # the model load's, shown by /health while loading
    started: float = field(default_factory=time.time)
    _template: object = None

    @property
    def backend(self) -> Backend:
        if self.scheduler.state != "ready":
            raise APIError(503, f"the model is {self.scheduler.state}; retry when /health says ready", code="model_not_ready", headers={"Retry-After": "5"})
        return self.scheduler.backend

    def template(self):
        """The chat template: the checkpoint's own, else the built-in GLM-5 one (compiled once)."""
        if self._template is None:
            from ..models.chat_template import ChatTemplate

            path = self.backend.info.checkpoint_dir
            self._template = ChatTemplate.from_model_dir(path) if path is not None else ChatTemplate.builtin()
        return self._template


def runtime() -> Runtime:
    return current_app.extensions["glm53"]


def check_model(name: str | None) -> None:
    served = runtime().settings.served_name
    if name is not None and name != served:
        raise APIError(404, f"model {name!r} does not exist; this server serves {served!r}", param="model", code="model_not_found")


def check_token_ids(ids: Sequence[int], param: str) -> None:
    vocab = runtime().backend.tokenizer.vocab_size
    bad = next((i for i in ids if i >= vocab), None)
    if bad is not None:
        raise APIError(400, f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)


def max_new_tokens(requested: int | None, prompt_len: int, param: str = "max_tokens") -> int:
    """The completion budget: the request's, capped to the context left after the prompt (default: all of it).

    :raise 400: when the prompt leaves no room in the context.
    """
    context = runtime().backend.info.context_length
    room = context - prompt_len
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", param="prompt")
    if room < 1:
        raise APIError(
            400,
            f"this model's maximum context length is {context} tokens; the prompt has {prompt_len} tokens, leaving no room for a completion",
            param="messages" if param == "max_tokens" else param,
            code="context_length_exceeded",
        )
    return room if requested is None else min(requested, room)


def top_k(requested: int | None) -> int:
    """The backend's top_k: 0 (off) for none, -1, or at least the vocabulary, which keep every token anyway
    (and a request's 10**30 would not fit the backends' integer types)."""
    if requested is None or requested == -1 or requested >= runtime().backend.info.vocab_size:
        return 0
    return requested


def sampling_params(req: SamplingFields, choice: int = 0) -> SamplingParams:
    """Request sampling fields over the OpenAI defaults; choice i of n gets seed + i (distinct, reproducible)."""
    bias = ()
    if req.logit_bias:
        bias = tuple((int(k), float(v)) for k, v in req.logit_bias.items())
        check_token_ids([b[0] for b in bias], "logit_bias")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=top_k(req.top_k),
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=bias,
        seed=None if req.seed is None else (req.seed + choice) % 2**64,
    )


class JobGroup:
    """Submits the jobs of one request and yields ``(choice index, event)`` until each job has ended.

    ``None`` is yielded when nothing arrived for ``keepalive_s`` (time for an SSE comment). A client that
    disconnects, or a consumer that stops iterating, cancels every job of the group (``close``).
    """

    def __init__(self, requests: Sequence[GenerationRequest | ScoreRequest], environ: dict):
        rt = runtime()
        self._scheduler = rt.scheduler
        self._metrics = rt.metrics
        self._t0 = time.monotonic()
        self._first_token_seen = False
        self._channel = make_channel()
        self._jobs = []
        self._open = 0
        self._watcher = None
        self.failed = False  # a job ended in error or was cancelled (set by sse_events)
        self._record = current_record()
        try:
            for index, request in enumerate(requests):
                self._jobs.append(self._scheduler.submit(request, lambda ev, i=index: self._channel.put((i, ev))))
                self._open += 1
        except QueueFull as exc:
            self.close()
            raise APIError(429, f"the server is at capacity ({exc}); retry shortly", code="server_busy", headers={"Retry-After": "1"}) from None
        except NotReady as exc:
            self.close()
            raise APIError(503, f"the model is not ready ({exc})", code="model_not_ready", headers={"Retry-After": "5"}) from None
        if self._record is not None:
            self._note_prompts(requests)
        self._watcher = DisconnectWatcher(environ, self._client_gone)

    def events(self, keepalive_s: float | None) -> Iterator[tuple[int, object] | None]:
        while self._open:
            items = self._channel.get_all(keepalive_s)
            if not items:
                if keepalive_s is not None:  # without a timeout, empty means a spurious wake-up
                    yield None
                continue
            for index, event in items:
                if isinstance(event, Delta) and event.token_ids and not self._first_token_seen:
                    self._first_token_seen = True
                    self._metrics.first_token(time.monotonic() - self._t0)
                    if self._record is not None:
                        self._record.first_token_s = time.monotonic() - self._t0
                if isinstance(event, (Finish, Scored)):
                    self._open -= 1
                    if not self._open:
                        self._metrics.completed(time.monotonic() - self._t0)
                if self._record is not None:
                    self._note_event(index, event)
                yield index, event

    def sse_events(self, keepalive_s: float) -> Iterator[str | tuple[int, object]]:
        """``events`` for a streamed response: ready SSE frames (a keep-alive comment while idle; the error frame
        of a job that failed or was cancelled, after which the stream stops and ``failed`` is set) or
        ``(choice index, event)`` for the caller to render."""
        for item in self.events(keepalive_s):
            if item is None:
                yield KEEPALIVE
                continue
            _, event = item
            if isinstance(event, Finish) and event.reason in ("error", "cancelled"):
                self.failed = True
                yield frame(engine_failure(event).body())
                return
            yield item

    def _note_prompts(self, requests: Sequence[GenerationRequest | ScoreRequest]) -> None:
        record = self._record
        ids = [r.prompt_ids if isinstance(r, GenerationRequest) else r.ids for r in requests]
        # the n choices of a prompt are consecutive jobs with the same prompt, counted once (as in `usage`)
        prompts = [p for i, p in enumerate(ids) if i == 0 or p != ids[i - 1]]
        record.prompt_tokens += sum(len(p) for p in prompts)
        if record.with_text:
            tokenizer = runtime().backend.tokenizer
            record.prompts += [tokenizer.decode(p) for p in prompts]

    def _note_event(self, index: int, event: object) -> None:
        record = self._record
        if isinstance(event, Delta):
            record.completion_tokens += len(event.token_ids)
            if record.with_text:
                record.completions.setdefault(index, []).append(event.text)
        elif isinstance(event, Finish):
            record.finishes.append(event.reason)
        elif isinstance(event, Scored):
            record.finishes.append("scored")

    def _client_gone(self) -> None:
        # a hang-up while jobs run is the client's doing, logged and counted as such whatever the response says;
        # once they have all ended, a close may simply follow a complete answer that is still being written
        if self._record is not None and self._open:
            self._record.client_gone = True
        self.cancel()

    def cancel(self) -> None:
        for job in self._jobs:
            self._scheduler.cancel(job)

    def close(self) -> None:
        """Stop watching the client; cancel jobs that have not ended (idempotent)."""
        if self._watcher is not None:
            self._watcher.stop()
        if self._open:
            self.cancel()
            if self._record is not None:
                self._record.finishes += ["cancelled"] * self._open
            self._open = 0

