"""A scripted backend for scheduler and server tests: each sequence emits a given token list, then EOS.

A constrained sequence emits its scripted token where the grammar allows it, else the lowest id it allows, so
a script that follows the grammar comes out unchanged and any other still gives grammatical output.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import numpy as np

from glm53.engine.constraints import Constraint, Vocabulary
from glm53.engine.interface import LogprobRequest, ModelInfo, SampledToken, SamplingParams, SequenceFailure, TokenLogprobs
from glm53.models.glm_special_tokens import SPECIAL_TOKENS

EOS = 256
# Script entries that are not tokens: a step that yields nothing (one more prefill step), and the step at which
# the sequence fails alone (step reports a SequenceFailure for it; the rest of the batch goes on).
PREFILL = -1
FAIL_ALONE = -4


# GLM's markers that the output parsers read, as single tokens after EOS, as GLM's tokenizer has them
MARKERS = tuple(t.text for t in SPECIAL_TOKENS if not t.control)


class ByteTokens:
    """Bytes are ids 0..255; 256 is EOS (text '<eos>'); 257 on are MARKERS (their text is matched as the token)."""

    vocab_size = 257 + len(MARKERS)
    special_ids = frozenset({EOS})
    _pattern = re.compile("|".join(re.escape(m) for m in MARKERS))

    def encode(self, text: str) -> list[int]:
        ids, done = [], 0
        for match in self._pattern.finditer(text):
            ids += list(text[done:match.start()].encode()) + [257 + MARKERS.index(match.group())]
            done = match.end()
        return ids + list(text[done:].encode())

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i >= EOS:
                out.append(buf.decode(errors="replace"))
                buf = bytearray()
                if i > EOS:
                    out.append(MARKERS[i - 257])
                elif not skip_special:
                    out.append("<eos>")
            else:
                buf.append(i)
        out.append(buf.decode(errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id > EOS:
            return MARKERS[token_id - 257].encode()
        return b"<eos>" if token_id == EOS else bytes([token_id])

    def vocabulary_bytes(self) -> list[bytes]:
        return [self.token_bytes(i) for i in range(self.vocab_size)]


def _logprobs(tok: int, request: LogprobRequest | None) -> TokenLogprobs | None:
    """A scripted token's logprob is -0.5; the runners-up are the next byte values at -1.5, -2.5, ..."""
    if request is None:
        return None
    return TokenLogprobs(-0.5, tuple(((tok + k) % (EOS + 1), -0.5 - k) for k in range(request.top_n)))


class ScriptedBackend:
    """Sequence i emits ``script(prompt_ids)`` one token per step (after a prefill step), then EOS forever.

    ``step_seconds`` makes each step take that long, as a real engine's does, so that a test can act while a
    sequence is in a given phase. ``cached(prompt_ids)`` is how many prompt tokens the first token reports as
    served from a prefix cache (default none).
    """

    def __init__(self, script=None, max_batch_size: int = 4, context_length: int = 4096, fail_on_step: int | None = None,
                 step_seconds: float = 0.0, refuse_leading_zero: bool = True, cached=None, max_score_tokens: int | None = None):
        self.tokenizer = ByteTokens()
        self.vocabulary = Vocabulary.from_token_bytes(self.tokenizer.vocabulary_bytes(), range(EOS, self.tokenizer.vocab_size), {EOS})
        self.info = ModelInfo("scripted", "test", context_length, self.tokenizer.vocab_size, frozenset({EOS}), max_score_tokens=max_score_tokens)
        self.max_batch_size = max_batch_size
        self._script = script or (lambda prompt: list(b"hello world"))
        self._cached = cached or (lambda prompt: 0)
        self.seqs: dict[int, list[int]] = {}
        self.constraints: dict[int, Constraint] = {}
        self._first_token_cached: dict[int, int] = {}  # sequences whose first token is still to come -> its cached tokens
        self._logprobs: dict[int, LogprobRequest | None] = {}
        self.added: list[int] = []
        self.removed: list[int] = []
        self.failed: set[int] = set()
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.step_seconds = step_seconds
        self.refuse_leading_zero = refuse_leading_zero  # a hook for tests of a backend that refuses a job
        self.max_active = 0

    def add(self, seq_id: int, prompt_ids: Sequence[int], sampling: SamplingParams, logprobs: LogprobRequest | None = None,
            constraint: Constraint | None = None) -> None:
        if seq_id in self.seqs:
            raise ValueError("duplicate")
        if self.refuse_leading_zero and prompt_ids and prompt_ids[0] == 0:
            raise ValueError("prompts starting with byte 0 are refused (test hook)")
        self.seqs[seq_id] = [PREFILL] + list(self._script(list(prompt_ids)))
        self._logprobs[seq_id] = logprobs
        self._first_token_cached[seq_id] = self._cached(list(prompt_ids))
        if constraint is not None:
            self.constraints[seq_id] = constraint
        self.added.append(seq_id)
        self.max_active = max(self.max_active, len(self.seqs))

    def remove(self, seq_id: int) -> None:
        if self.seqs.pop(seq_id, None) is not None:
            self.removed.append(seq_id)
        self.failed.discard(seq_id)
        self._first_token_cached.pop(seq_id, None)
        self._logprobs.pop(seq_id, None)
        self.constraints.pop(seq_id, None)

    def step(self) -> dict[int, list[SampledToken] | SequenceFailure]:
        self.steps += 1
        if self.step_seconds:
            time.sleep(self.step_seconds)
        if self.fail_on_step == self.steps:
            raise RuntimeError("injected step failure")
        out = {}
        for seq_id, queue in self.seqs.items():
            if seq_id in self.failed:
                continue  # the contract: a failed sequence is fed nothing more
            tok = queue.pop(0) if queue else EOS
            if tok == FAIL_ALONE:
                self.failed.add(seq_id)
                out[seq_id] = SequenceFailure(f"injected failure of sequence {seq_id}")
            elif tok != PREFILL:
                tok = self._allowed(seq_id, tok)
                out[seq_id] = [SampledToken(tok, _logprobs(tok, self._logprobs[seq_id]), self._first_token_cached.pop(seq_id, 0))]
        return out

    def _allowed(self, seq_id: int, tok: int) -> int:
        constraint = self.constraints.get(seq_id)
        if constraint is None:
            return tok
        row = np.zeros(self.vocabulary.mask_words, dtype=np.int32)
        constraint.fill_mask(row)
        allowed = [i for i in range(self.tokenizer.vocab_size) if row[i >> 5] >> (i & 31) & 1]
        chosen = tok if tok in allowed else allowed[0]
        constraint.advance(chosen)
        return chosen

    def score(self, ids, start, request):
        yield None
        yield [None if p == 0 else TokenLogprobs(-1.0 * p) for p in range(start, len(ids))]

    def stats(self) -> dict:
        prefilling = sum(1 for queue in self.seqs.values() if queue and queue[0] == PREFILL)
        return {"steps": self.steps, "active_sequences": len(self.seqs), "prefilling": prefilling}

    def close(self) -> None:
        pass
