"""Incremental detokenisation: text deltas from a growing list of token ids.

Decoding token by token is wrong for byte-level BPE (a character can span tokens) and for tokenizers whose
pieces change shape next to their neighbours, so each delta is the difference between decoding a short window
with and without the newest tokens. Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD),
but never for more than ``MAX_PENDING`` tokens, so a model that emits invalid bytes still streams.
"""

from __future__ import annotations

from .interface import Tokenizer

MAX_PENDING = 6  # a UTF-8 character is at most 4 bytes; byte tokens beyond that will never complete it
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window: context that makes piece boundaries right
        self._read = 0  # tokens before this index have been emitted as text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special=self._skip_special)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that became certain (possibly empty)."""
        self._ids.append(token_id)
        return self._advance(force=False)

    def flush(self) -> str:
        """Return whatever is still held back (at the end of a completion)."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self._ids))
        pending = len(self._ids) - self._read
        if not force and after.endswith(REPLACEMENT) and pending < MAX_PENDING:
            return ""
        delta = after[len(before):] if after.startswith(before) else after
        self._prefix, self._read = self._read, len(self._ids)
        return delta
