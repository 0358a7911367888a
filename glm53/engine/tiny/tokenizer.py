"""A byte-level tokenizer for the CPU demo model: 256 byte ids, then the GLM-5 special tokens.

Ids 0..255 are the UTF-8 bytes of the text; id ``256 + i`` is ``SPECIAL_TOKENS[i]``. The GLM-5.3 ids of the
specials are not used here: the demo model has its own compact vocabulary, and the server only ever asks
the tokenizer for ids, never for GLM's numbering.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from glm53.models.glm_special_tokens import SPECIAL_TOKENS

N_BYTES = 256


class ByteTokenizer:
    def __init__(self) -> None:
        self._texts = tuple(t.text for t in SPECIAL_TOKENS)
        self._ids = {text: N_BYTES + i for i, text in enumerate(self._texts)}
        self.vocab_size = N_BYTES + len(self._texts)
        self.special_ids = frozenset(N_BYTES + i for i, t in enumerate(SPECIAL_TOKENS) if t.control)
        self.eos_ids = frozenset(N_BYTES + i for i, t in enumerate(SPECIAL_TOKENS) if t.ends_completion)
        # Alternation tries its branches in order, so listing longer texts first makes the match at any
        # position the longest special token that starts there.
        by_length = sorted(self._texts, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(text) for text in by_length))

    def vocabulary_bytes(self) -> list[bytes]:
        """Every id's bytes in id order (:meth:`token_bytes` of each), for the grammar vocabulary
        (``engine/constraints.py``)."""
        return [self.token_bytes(i) for i in range(self.vocab_size)]

    def id_of(self, text: str) -> int:
        """Id of a special token's text (``"<|user|>"``); raises KeyError for anything else."""
        return self._ids[text]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: each special token's text becomes its id, everything else UTF-8 bytes."""
        ids: list[int] = []
        done = 0
        for match in self._pattern.finditer(text):
            ids.extend(_utf8(text[done : match.start()]))
            ids.append(self._ids[match.group()])
            done = match.end()
        ids.extend(_utf8(text[done:]))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; incomplete or invalid UTF-8 becomes U+FFFD.

        :param skip_special: drop control markers (``special_ids``); markers the output parsers read stay.
        :raise ValueError: an id outside the vocabulary.
        """
        parts: list[str] = []
        run = bytearray()  # bytes since the last special token, decoded together so multibyte chars join
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary (0..{self.vocab_size - 1})")
            if token < N_BYTES:
                run.append(token)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not (skip_special and token in self.special_ids):
                parts.append(self._texts[token - N_BYTES])
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_bytes(self, token_id: int) -> bytes:
        """:raise ValueError: an id outside the vocabulary."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return bytes([token_id]) if token_id < N_BYTES else self._texts[token_id - N_BYTES].encode()


def _utf8(text: str) -> bytes:
    # JSON input can carry a lone surrogate ("\ud800"); encoding must not fail on it, and its bytes decode
    # back to U+FFFD like any other invalid UTF-8.
    return text.encode("utf-8", errors="surrogatepass")
