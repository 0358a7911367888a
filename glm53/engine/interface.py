"""The engine's contracts: what the server hands the scheduler and gets back (a request, then its events), and
what the scheduler asks of a model backend.

A generation job is a :class:`GenerationRequest` answered by :class:`Delta` events and one :class:`Finish`; a scoring
job is a :class:`ScoreRequest` answered by one :class:`Scored` (or a :class:`Finish` when it fails).

A backend (the CPU demo model in ``engine/tiny``, the exllamav3 model on a GPU) owns the weights, the
caches and sampling. The scheduler (``engine/scheduler.py``) owns what is the same for every backend:
the job queue, admission, incremental detokenisation, stop conditions, finish reasons and events.
Every backend method is called from the scheduler's thread only, so a backend needs no locking.

Lifecycle of a sequence: ``add`` → ``step`` (prefill, possibly over several steps, then one sampled token
per step) → ``remove`` (after the scheduler saw a stop condition or the client went away). A token returned
by ``step`` is already part of the sequence: the backend feeds it in the next step unless ``remove`` is
called first. A backend that keeps a prefix cache (keys and values of earlier prompts, reused when a new prompt
starts the same way) says on the sequence's first token how many prompt tokens it did not have to prefill.

A sequence added with a :class:`~glm53.engine.constraints.Constraint` samples only what its grammar allows: the
backend applies the constraint's mask before sampling each of its tokens and advances it with the sampled token
(``engine/constraints.py``); the scheduler ends the sequence where the grammar ends.

Failures come in two sizes. A fault the backend can pin on one sequence (non-finite logits in its row, cache
pages that could not be extended for it) is reported by ``step`` as a :class:`SequenceFailure` in place of that sequence's tokens: the scheduler
ends that job alone with an error and calls ``remove``, and every other sequence of the batch goes on. An
exception out of ``step`` means the backend cannot say which sequences are affected, so the scheduler ends
every active job; a backend should raise only when that is true.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .constraints import CompiledGrammar, Constraint, Vocabulary


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Values are validated at the HTTP boundary (``server/protocol.py``)."""

    temperature: float = 1.0  # <= 0 means greedy (argmax); top_k/top_p/min_p are then irrelevant
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    seed: int | None = None  # per-sequence generator; None: nondeterministic

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class LogprobRequest:
    """Which log-probabilities to report for a position (in addition to the actual token's)."""

    top_n: int = 0  # the n most likely tokens, best first
    token_ids: tuple[int, ...] = ()  # these ids, always, in this order


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (natural log, full-vocabulary softmax of the raw logits) at one position."""

    logprob: float  # of the token actually at (or sampled for) this position
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first, len == top_n
    requested: tuple[tuple[int, float], ...] = ()  # (token id, logprob) for LogprobRequest.token_ids


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None  # set when the sequence was added with a LogprobRequest
    # On a sequence's first token only: how many of its prompt tokens the backend took from its prefix cache
    # instead of prefilling them (0 for a backend without one). The scheduler reads it there and nowhere else.
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class SequenceFailure:
    """What ``step`` returns for a sequence that failed alone (see the module docstring)."""

    reason: str  # one sentence for the client and the log, e.g. "non-finite logits at position 812"


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that the scheduler and the server need."""

    name: str  # what /server_info reports as the model (the served name is a separate setting)
    architecture: str
    context_length: int  # most tokens one sequence may hold: prompt + completion
    vocab_size: int
    eos_token_ids: frozenset[int]  # any of these ends a completion (unless the request ignores EOS)
    checkpoint_dir: Path | None = None  # its chat template is used when it has one; else the built-in GLM-5 one
    facts: Mapping[str, object] = field(default_factory=dict)  # load time, memory use, shapes: shown in /server_info
    gpu: Mapping[str, object] | None = None  # the GPU the model runs on (engine/gpu.py); None for a CPU backend
    max_score_tokens: int | None = None  # most tokens one teacher-forced scoring forward takes; None: the context


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int  # the scheduler also stops at the context length
    sampling: SamplingParams = SamplingParams()
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # in addition to the model's EOS ids
    ignore_eos: bool = False
    skip_special: bool = False  # drop control markers from the text (token ids are unaffected)
    logprobs: LogprobRequest | None = None
    grammar: CompiledGrammar | None = None  # what the completion must follow; it ends where the grammar does


@dataclass(frozen=True)
class ScoreRequest:
    ids: tuple[int, ...]
    start: int
    logprobs: LogprobRequest


@dataclass(frozen=True)
class Delta:
    """New output of one step: the tokens and the text that became certain (may be empty)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    cached_tokens: int | None = None  # on a job's first Delta only: its prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Finish:
    """Last event of a generation job."""

    reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    matched: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the backend's prefix cache (0 if it ended before a token)


@dataclass(frozen=True)
class Scored:
    """Result of a scoring job (its only event unless it fails)."""

    entries: list[TokenLogprobs | None]


class Tokenizer(Protocol):
    vocab_size: int
    special_ids: frozenset[int]  # ids whose text is a control marker (dropped by decode(skip_special=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; the text of a special token (``<|user|>``) becomes that token's id."""

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; bytes that do not form complete UTF-8 yet decode to U+FFFD."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text: a piece of a UTF-8 character for a token that splits one, a
        special token's own text for a special token."""


class Backend(Protocol):
    info: ModelInfo
    tokenizer: Tokenizer
    vocabulary: Vocabulary  # the tokenizer as grammars see it (constrained decoding compiles against it)
    max_batch_size: int  # sequences that may be added at once

    def add(
        self,
        seq_id: int,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        logprobs: LogprobRequest | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """Start a sequence. ``len(prompt_ids)`` is at least 1 and below ``info.context_length``. With a
        ``constraint``, every token is sampled from what it allows and advances it."""

    def remove(self, seq_id: int) -> None:
        """Forget a sequence and free its cache. Unknown ids are ignored (a cancel may race a finish)."""

    def step(self) -> dict[int, list[SampledToken] | SequenceFailure]:
        """Run one forward pass over the active sequences.

        :return: for each sequence that produced tokens this step, the tokens in order (one per step for
            plain decoding; a sequence that is still prefilling is absent); for a sequence that failed alone,
            a :class:`SequenceFailure` instead (the backend feeds it nothing more; ``remove`` follows).
        :raise Exception: a failure that cannot be pinned on particular sequences (it ends every active job).
        """

    def score(self, ids: Sequence[int], start: int, request: LogprobRequest) -> Iterator[list[TokenLogprobs | None] | None]:
        """Teacher-forced log-probabilities of ``ids`` at positions ``start .. len(ids)-1``.

        Entry j describes position ``start + j``: the distribution that predicted ``ids[start + j]`` from
        the tokens before it, with ``logprob`` of that actual token. Position 0 has no prediction: None.
        The iterator yields None after each chunk of work, so the scheduler can run decode steps between
        chunks, and yields the list of entries last.
        """

    def stats(self) -> dict:
        """Backend counters for /stats and /metrics (numbers, or dicts of numbers)."""

    def close(self) -> None:
        """Release the model (called once, at shutdown)."""
