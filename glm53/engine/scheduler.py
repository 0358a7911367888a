"""The scheduler: one native OS thread that owns the backend and steps it.

Requests arrive from any thread through :meth:`Scheduler.submit` (generation) and :meth:`Scheduler.score`
(teacher-forced log-probabilities); events leave through each job's ``sink``, a callable that must be
thread-safe and must not block (the server's sink wakes the waiting greenlet through the gevent hub). The
loop: take new work and cancellations, admit waiting jobs first come first served up to the backend's batch
size, advance one chunk of a pending scoring job, run one backend step, turn the sampled tokens into text and
events, retire finished jobs. A job's events go out as soon as its step returns; nothing waits for a later step.

The backend is created on this thread too, so loading a model never blocks the server's event loop; until it
is ready, :attr:`state` is ``loading``.
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .constraints import Constraint
from .detok import IncrementalDetokenizer
from .interface import Backend, Delta, Finish, GenerationRequest, SampledToken, Scored, ScoreRequest, SequenceFailure
from .stops import StopMatcher
from .threads import NativeQueue, QueueEmpty, native_lock, start_native_thread

log = logging.getLogger(__name__)

RATE_WINDOW_S = 5.0


class QueueFull(Exception):
    """More work than ``max_batch_size + max_queue`` is in the system."""


class NotReady(Exception):
    """The backend is still loading, failed to load, or the scheduler stopped."""


@dataclass(eq=False)
class Job:
    id: int
    request: GenerationRequest | ScoreRequest
    sink: Callable[[object], None]
    # scheduler-thread state
    completion_tokens: int = 0
    cached_tokens: int = 0
    detok: IncrementalDetokenizer | None = None
    stops: StopMatcher | None = None
    constraint: Constraint | None = None  # this job's walk through its request's grammar
    scoring: Iterator | None = None


class Scheduler:
    def __init__(self, backend_factory: Callable[[], Backend], max_queue: int):
        self._factory = backend_factory
        self._max_queue = max_queue
        self._inbox = NativeQueue()
        self._lock = native_lock()  # guards _in_system, shared with the submitting threads
        self._in_system = 0
        self._ids = itertools.count(1)
        self.backend: Backend | None = None
        self.state = "loading"  # loading | ready | failed | stopped
        self.error: str | None = None
        self.load_seconds: float | None = None
        self._waiting: deque[Job] = deque()
        self._active: dict[int, Job] = {}
        self._scoring: deque[Job] = deque()
        self._recent: deque[tuple[float, int]] = deque()  # (step end time, tokens) over the last RATE_WINDOW_S
        self.decode_rate = 0.0  # tokens per second over the recent window, all jobs together
        self.counters = {
            "jobs_submitted": 0, "jobs_finished": 0, "jobs_stop": 0, "jobs_length": 0, "jobs_cancelled": 0,
            "jobs_error": 0, "jobs_rejected": 0, "score_jobs": 0, "prompt_tokens": 0, "completion_tokens": 0,
            "steps": 0, "step_seconds": 0.0, "engine_errors": 0, "sequence_errors": 0,
            # in prompt tokens, of the jobs whose prefill completed: taken from the backend's prefix cache, or prefilled
            # (a hits/misses pair: bench/sweep.py derives each phase's hit rate from it)
            "prefix_cache_hits": 0, "prefix_cache_misses": 0,
        }

    # ----- called from any thread

    def start(self, on_failure: Callable[[str], None] | None = None) -> None:
        self._on_failure = on_failure
        start_native_thread(self._run)

    def submit(self, request: GenerationRequest | ScoreRequest, sink: Callable[[object], None]) -> Job:
        """Queue a job. :raise NotReady: while loading or after a failure. :raise QueueFull: over the limit."""
        if self.state != "ready":
            raise NotReady(self.state if self.error is None else f"{self.state}: {self.error}")
        limit = self.backend.max_batch_size + self._max_queue
        with self._lock:
            if self._in_system >= limit:
                self.counters["jobs_rejected"] += 1
                raise QueueFull(f"{self._in_system} requests in progress or queued (limit {limit})")
            self._in_system += 1
        job = Job(next(self._ids), request, sink)
        self._inbox.put(("job", job))
        return job

    def cancel(self, job: Job) -> None:
        """Stop a job (client went away); its Finish(cancelled) follows unless it already finished."""
        self._inbox.put(("cancel", job.id))

    def stop(self) -> None:
        self._inbox.put(("stop", None))

    def snapshot(self) -> dict:
        """Queue and counter figures for /stats and /metrics (read without locking: figures, not invariants)."""
        steps = self.counters["steps"]
        looked_up = self.counters["prefix_cache_hits"] + self.counters["prefix_cache_misses"]
        return {
            "state": self.state,
            "waiting": len(self._waiting),
            "active": len(self._active),
            "scoring": len(self._scoring),
            "in_system": self._in_system,
            "mean_step_ms": round(1000 * self.counters["step_seconds"] / steps, 3) if steps else None,
            "decode_tokens_per_second": round(self.decode_rate, 2) if self._recent_is_fresh() else 0.0,
            "prefix_cache_hit_rate": round(self.counters["prefix_cache_hits"] / looked_up, 4) if looked_up else None,
            **self.counters,
        }

    # ----- the scheduler thread

    def _run(self) -> None:
        if not self._load():
            return
        while self.state == "ready":
            idle = not (self._waiting or self._active or self._scoring)
            if not self._take_messages(block=idle):
                break
            self._admit()
            if self._scoring:
                self._advance_scoring()
            if self._active:
                self._step()
        self._shutdown()

    def _load(self) -> bool:
        t0 = time.monotonic()
        try:
            self.backend = self._factory()
        except BaseException as exc:  # noqa: BLE001 - any load failure ends the server with its reason
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"
            log.error("model load failed: %s\n%s", self.error, traceback.format_exc())
            if self._on_failure:
                self._on_failure(self.error)
            return False
        self.load_seconds = time.monotonic() - t0
        self.state = "ready"
        log.info("backend %s ready in %.1f s", self.backend.info.name, self.load_seconds)
        return True

    def _take_messages(self, block: bool) -> bool:
        """Apply queued messages; returns False on stop."""
        try:
            msg = self._inbox.get() if block else self._inbox.get_nowait()
        except QueueEmpty:
            return True
        while True:
            kind, payload = msg
            if kind == "stop":
                return False
            if kind == "job":
                self.counters["jobs_submitted"] += 1
                (self._scoring if isinstance(payload.request, ScoreRequest) else self._waiting).append(payload)
            elif kind == "cancel":
                self._cancel(payload)
            try:
                msg = self._inbox.get_nowait()
            except QueueEmpty:
                return True

    def _cancel(self, job_id: int) -> None:
        job = self._active.get(job_id)
        if job is not None:
            self._retire(job, "cancelled")
            return
        for queue in (self._waiting, self._scoring):
            for job in queue:
                if job.id == job_id:
                    queue.remove(job)
                    self._finish_unstarted(job, "cancelled")
                    return

    def _admit(self) -> None:
        backend = self.backend
        while self._waiting and len(self._active) < backend.max_batch_size:
            job = self._waiting.popleft()
            req: GenerationRequest = job.request
            job.detok = IncrementalDetokenizer(backend.tokenizer, req.skip_special)
            job.stops = StopMatcher(req.stop_strings)
            job.constraint = req.grammar.start() if req.grammar is not None else None
            try:
                backend.add(job.id, req.prompt_ids, req.sampling, req.logprobs, job.constraint)
            except Exception as exc:  # noqa: BLE001 - a job the backend refuses fails alone
                log.exception("backend refused job %d", job.id)
                self._finish_unstarted(job, "error", f"{type(exc).__name__}: {exc}")
                continue
            self.counters["prompt_tokens"] += len(req.prompt_ids)
            self._active[job.id] = job

    def _advance_scoring(self) -> None:
        job = self._scoring[0]
        req: ScoreRequest = job.request
        try:
            if job.scoring is None:
                job.scoring = self.backend.score(req.ids, req.start, req.logprobs)
            result = next(job.scoring)
        except Exception as exc:  # noqa: BLE001 - a failed scoring job fails alone
            log.exception("scoring job %d failed", job.id)
            self._scoring.popleft()
            self._finish_unstarted(job, "error", f"{type(exc).__name__}: {exc}")
            return
        if result is not None:
            self._scoring.popleft()
            self.counters["score_jobs"] += 1
            self._release(job)
            self._deliver(job, Scored(result))

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            produced = self.backend.step()
        except Exception as exc:  # noqa: BLE001 - the batch's jobs fail, the server keeps serving
            log.exception("backend step failed; ending the %d active jobs", len(self._active))
            self.counters["engine_errors"] += 1
            for job in list(self._active.values()):
                self._retire(job, "error", error=f"{type(exc).__name__}: {exc}")
            return
        t1 = time.monotonic()
        self.counters["steps"] += 1
        self.counters["step_seconds"] += t1 - t0
        self._note_rate(t1, sum(len(out) for out in produced.values() if not isinstance(out, SequenceFailure)))
        for job_id, out in produced.items():
            job = self._active.get(job_id)
            if job is None:
                continue
            if isinstance(out, SequenceFailure):
                self._fail(job, out.reason)
            elif job.constraint is not None and job.constraint.error is not None:
                self._fail(job, f"a sampled token broke the request's grammar: {job.constraint.error}")
            else:
                self._consume(job, out)

    def _fail(self, job: Job, reason: str) -> None:
        """End one job the backend failed alone; the rest of the batch goes on."""
        log.error("engine failed job %d alone: %s", job.id, reason)
        self.counters["sequence_errors"] += 1
        self._retire(job, "error", error=reason)

    def _note_rate(self, now: float, tokens: int) -> None:
        self._recent.append((now, tokens))
        while self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        span = now - self._recent[0][0]
        total = sum(n for _, n in self._recent)
        self.decode_rate = total / span if span > 0 else 0.0

    def _recent_is_fresh(self) -> bool:
        try:
            return time.monotonic() - self._recent[-1][0] < RATE_WINDOW_S
        except IndexError:
            return False

    def _consume(self, job: Job, tokens: list[SampledToken]) -> None:
        """Turn one step's tokens of a job into a Delta, and retire the job if a stop condition hit."""
        req: GenerationRequest = job.request
        backend = self.backend
        first = job.completion_tokens == 0
        if first:
            self._note_prefill(job, tokens[0].cached_prompt_tokens)
        eos = frozenset() if req.ignore_eos else backend.info.eos_token_ids
        limit = min(req.max_new_tokens, backend.info.context_length - len(req.prompt_ids))
        text, ids, lps, finish = [], [], [], None
        for tok in tokens:
            job.completion_tokens += 1
            self.counters["completion_tokens"] += 1
            ids.append(tok.token_id)
            if tok.logprobs is not None:
                lps.append(tok.logprobs)
            if tok.token_id in eos or tok.token_id in req.stop_token_ids:
                finish = ("stop", tok.token_id)
            else:
                emitted, matched = job.stops.feed(job.detok.add(tok.token_id))
                text.append(emitted)
                if matched is not None:
                    finish = ("stop", matched)
            if finish is None and job.constraint is not None and job.completion_tokens == job.constraint.ended_at:
                finish = ("stop", None)  # the grammar is complete and admits nothing more
            if finish is None and job.completion_tokens >= limit:
                finish = ("length", None)
            if finish is not None:
                break
        if finish is not None and not isinstance(finish[1], str):
            # ended by EOS, a stop token or the length: release text held back for UTF-8 or a possible stop match
            tail, matched = job.stops.feed(job.detok.flush())
            text.append(tail)
            if matched is None:
                text.append(job.stops.flush())
            else:
                finish = ("stop", matched)
        self._deliver(job, Delta("".join(text), tuple(ids), tuple(lps) if req.logprobs else None, job.cached_tokens if first else None))
        if finish is not None:
            self._retire(job, finish[0], matched=finish[1])

    def _note_prefill(self, job: Job, cached: int) -> None:
        """A job's prefill completed (its first token arrived): count its prompt as prefix-cache hits and misses."""
        job.cached_tokens = cached
        self.counters["prefix_cache_hits"] += cached
        self.counters["prefix_cache_misses"] += len(job.request.prompt_ids) - cached

    def _retire(self, job: Job, reason: str, matched: str | int | None = None, error: str | None = None) -> None:
        """End an admitted job: free its sequence, then send its Finish."""
        finish = Finish(reason, len(job.request.prompt_ids), job.completion_tokens, matched, error, job.cached_tokens)
        self._active.pop(job.id, None)
        try:
            self.backend.remove(job.id)
        except Exception:  # noqa: BLE001 - freeing must not take the scheduler down
            log.exception("backend.remove(%d) failed", job.id)
        self._count_finish(finish.reason)
        self._release(job)  # before the event: whoever sees the finish may submit again at once
        self._deliver(job, finish)

    def _finish_unstarted(self, job: Job, reason: str, error: str | None = None) -> None:
        prompt = len(job.request.prompt_ids) if isinstance(job.request, GenerationRequest) else len(job.request.ids)
        self._count_finish(reason)
        self._release(job)
        self._deliver(job, Finish(reason, prompt, 0, error=error))

    def _count_finish(self, reason: str) -> None:
        self.counters["jobs_finished"] += 1
        self.counters["jobs_" + reason] += 1

    def _release(self, job: Job) -> None:
        with self._lock:
            self._in_system -= 1

    def _deliver(self, job: Job, event: object) -> None:
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - a broken sink must not stop other jobs
            log.exception("event sink of job %d failed", job.id)

    def _shutdown(self) -> None:
        for job in list(self._active.values()):
            self._retire(job, "cancelled", error="server shutting down")
        while self._waiting:
            self._finish_unstarted(self._waiting.popleft(), "cancelled", "server shutting down")
        while self._scoring:
            self._finish_unstarted(self._scoring.popleft(), "cancelled", "server shutting down")
        self.state = "stopped"
        try:
            self.backend.close()
        except Exception:  # noqa: BLE001
            log.exception("backend.close failed")
