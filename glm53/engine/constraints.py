"""Grammar-constrained decoding: what a request allows the model to write, one token at a time (llguidance).

A request's grammar is compiled once, when the request is validated (``compile_grammar``: a grammar llguidance
cannot compile is the client's error, answered before anything runs). Each sequence then walks it with its own
``Constraint``: before a token is sampled, ``fill_mask`` writes which tokens the grammar allows next; after, the
backend calls ``advance`` with the sampled one. Where the grammar admits nothing more, ``ended_at`` says after
how many tokens, and the scheduler ends the sequence there.

Backends apply the masks: the CPU demo through ``MaskWorker`` (computed on a worker thread while its forward
runs, ``engine/tiny/backend.py``), the GPU engine through exllamav3's filter interface
(``engine/exl3/grammar_filter.py``), whose filter threads compute them while the forward runs on the GPU. A
batch mixes constrained and free sequences: a free sequence has no ``Constraint`` and no mask.

llguidance knows one end-of-sequence token; a GLM model has several (a turn ends with ``<|endoftext|>``,
``<|user|>`` or ``<|observation|>``). Every one of the model's EOS ids is allowed where the grammar may end, and
counts as its end.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

log = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "regex", "lark", "ebnf")
MAX_ERROR_CHARS = 600  # llguidance's messages can quote a whole grammar; the start says what is wrong
# JSON is written the way json.dumps writes it: one line, ", " and ": " between items, no other whitespace. A
# model left free to add whitespace can spend its whole budget on it (a common failure of JSON modes).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance marks a special token in its byte table with this byte, which no UTF-8 text contains
SPECIAL_MARKER = b"\xff"


class GrammarError(ValueError):
    """llguidance cannot compile a grammar (a syntax error, an unsupported JSON-Schema keyword); says why."""


class Vocabulary:
    """A backend's tokenizer as llguidance sees it, with the model's end-of-sequence ids; built once per backend.

    :param ll_tokenizer: llguidance's tokenizer (``from_hf`` or ``from_token_bytes`` make one).
    :param eos_ids: every id that ends a completion; ``ll_tokenizer.eos_token`` must be one of them.
    :param special_tokens: text -> id of the tokens llguidance matches only whole (``<tool_call>``, ``</think>``),
        never as the bytes of their text; a grammar names one by its id, ``<[154843]>``.
    """

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, eos_ids: Collection[int], special_tokens: Mapping[str, int]):
        if ll_tokenizer.eos_token not in eos_ids:
            raise ValueError(f"llguidance's EOS token {ll_tokenizer.eos_token} is not among the model's EOS ids {sorted(eos_ids)}")
        self.ll = ll_tokenizer
        self.size = ll_tokenizer.vocab_size  # ids at or past it are never allowed
        self.mask_words = (self.size + 31) // 32  # an allowed-token mask: one bit per id, 32 to an int32 word
        self.eos_ids = frozenset(eos_ids)
        self.special_tokens = dict(special_tokens)

    @classmethod
    def from_hf(cls, hf_tokenizer, vocab_size: int, eos_ids: Collection[int]) -> Vocabulary:
        """From a ``tokenizers.Tokenizer`` (about a second for GLM's 155k ids).

        :param vocab_size: the model's logits width, which may pad past the tokenizer's own ids.
        """
        eos = min(eos_ids)  # GLM's <|endoftext|> is the lowest of its end ids
        ll = llguidance.LLTokenizer(hf_tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
        # llguidance's own rule for which added tokens it matches whole: special ones and any "<...>"
        special = {t.content: i for i, t in hf_tokenizer.get_added_tokens_decoder().items()
                   if t.special or (t.content.startswith("<") and t.content.endswith(">"))}
        return cls(ll, eos_ids, special)

    @classmethod
    def from_token_bytes(cls, tokens: Sequence[bytes], special_ids: Collection[int], eos_ids: Collection[int]) -> Vocabulary:
        """From a table of every id's bytes, for a tokenizer without merges (each byte its own token); a special
        token's entry is its text, matched only as that token."""
        table = _TokenTable(tokens, special_ids, min(eos_ids))
        special = {tokens[i].decode("utf-8", errors="replace"): i for i in special_ids}
        return cls(llguidance.LLTokenizer(llguidance.TokenizerWrapper(table)), eos_ids, special)

    def marker(self, text: str) -> str:
        """How a grammar writes a control marker such as ``<tool_call>``: its special token, by id.

        The marker's text spelled in bytes is no substitute: llguidance's lexer is greedy, so free text before a
        spelled-out marker would swallow its first bytes.

        :raise GrammarError: the tokenizer has no such token.
        """
        token = self.special_tokens.get(text)
        if token is None:
            raise GrammarError(f"the tokenizer has no {text} token, which this grammar needs")
        return f"<[{token}]>"


class _TokenTable:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer: token bytes, specials marked, an encoder."""

    def __init__(self, tokens: Sequence[bytes], special_ids: Collection[int], eos_id: int):
        self.tokens = [SPECIAL_MARKER + t if i in special_ids else t for i, t in enumerate(tokens)]
        self.special_token_ids = sorted(special_ids)
        self.eos_token_id = eos_id
        self.bos_token_id = None

    def __call__(self, text: bytes) -> list[int]:
        return list(text)  # every byte is its own token; specials are never made from text here


class CompiledGrammar:
    """A grammar compiled for one vocabulary; ``start`` gives each sequence its own walk through it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: Vocabulary):
        self._pristine = matcher  # never advanced: only copied, by the scheduler thread
        self.vocabulary = vocabulary

    def start(self) -> Constraint:
        return Constraint(self._pristine.deep_copy(), self.vocabulary)


def compile_grammar(kind: str, source: str, vocabulary: Vocabulary) -> CompiledGrammar:
    """Compile a grammar: ``json_schema`` (JSON text), ``regex`` (Rust regex syntax), ``lark`` (llguidance's Lark
    dialect) or ``ebnf`` (llama.cpp's GBNF). Can take tens of milliseconds for a large schema, without the GIL.

    :raise GrammarError: the grammar does not compile; the message says why.
    """
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")
    try:
        if kind == "json_schema":  # a schema's own "x-guidance" options come after these
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT)
        else:
            grammar = llguidance.grammar_from(kind, source)
    except ValueError as exc:  # not JSON, or GBNF its converter cannot read
        raise GrammarError(_short(str(exc))) from None
    matcher = llguidance.LLMatcher(vocabulary.ll, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(_short(matcher.get_error()))
    return CompiledGrammar(matcher, vocabulary)


def with_json_layout(schema: dict) -> dict:
    """``schema`` with JSON_LAYOUT as its llguidance options, for a schema inlined in a Lark grammar (``%json``),
    which takes options only from the schema itself; the schema's own options win."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_LAYOUT, **(own if isinstance(own, dict) else {})}}


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


class Constraint:
    """One sequence's walk through a grammar. Its methods are called in turn (never at once) by the backend's
    threads: ``fill_mask`` before a token is sampled, ``advance`` after."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: Vocabulary):
        self._matcher = matcher
        self._vocabulary = vocabulary
        self._eos = vocabulary.ll.eos_token
        self.tokens = 0  # tokens advanced over
        self.ended_at: int | None = None  # tokens advanced over when the grammar admitted nothing more (or failed)
        self.error: str | None = None  # why the walk failed: a token the grammar does not allow was sampled

    @property
    def mask_words(self) -> int:
        return self._vocabulary.mask_words

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` [mask_words] int32: bit ``i & 31`` of word ``i >> 5`` is id i."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        bits = row.view(np.uint32)
        if bits[self._eos >> 5] >> np.uint32(self._eos & 31) & 1:
            for i in self._vocabulary.eos_ids:
                bits[i >> 5] |= np.uint32(1 << (i & 31))

    def advance(self, token: int) -> None:
        """Move past a sampled token; sets ``ended_at`` where the grammar is complete or the token broke it."""
        self.tokens += 1
        if self.ended_at is not None:
            return
        matcher = self._matcher
        # another of the model's EOS ids is the end, unless the grammar names that token itself
        if token in self._vocabulary.eos_ids and token != self._eos and matcher.try_consume_tokens([token]) == 0:
            token = self._eos
        matcher.consume_token(token)
        if matcher.is_error():
            self.error = _short(matcher.get_error())
            log.error("a sequence left its grammar: %s", self.error)
        if matcher.is_error() or matcher.is_stopped():
            self.ended_at = self.tokens


class MaskWorker:
    """Computes a batch's allowed-token masks on a worker thread, so that they are ready when the forward is.

    :param width: the logits' width; ids at or past the vocabulary's size are never allowed in a constrained row.
    """

    def __init__(self, width: int) -> None:
        self._width = width
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm53-masks")

    def start(self, constraints: Sequence[Constraint | None]) -> Future[torch.Tensor | None]:
        """Masks for one row each: [B, width] bool (True: allowed), a free row allowing everything; None when no
        row is constrained."""
        if all(c is None for c in constraints):
            done: Future = Future()
            done.set_result(None)
            return done
        return self._pool.submit(self._masks, list(constraints))

    def _masks(self, constraints: list[Constraint | None]) -> torch.Tensor:
        vocabulary = next(c for c in constraints if c is not None)._vocabulary
        words = np.zeros((len(constraints), vocabulary.mask_words), dtype=np.int32)  # [B, W]
        for row, constraint in zip(words, constraints):
            if constraint is not None:
                constraint.fill_mask(row)
        allowed = torch.zeros(len(constraints), self._width, dtype=torch.bool)  # [B, width]
        size = min(vocabulary.size, self._width)
        allowed[:, :size] = unpack_masks(torch.from_numpy(words), size)
        allowed[[i for i, c in enumerate(constraints) if c is None]] = True
        return allowed

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def unpack_masks(words: torch.Tensor, size: int) -> torch.Tensor:
    """[B, W] int32 bitmasks -> [B, size] bool (size <= 32 W)."""
    shifts = torch.arange(32, dtype=torch.int32)  # [32]
    bits = (words[:, :, None] >> shifts) & 1  # [B, W, 32]; the arithmetic shift keeps bit 31 readable
    return bits.reshape(words.shape[0], -1)[:, :size].bool()


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [B, V] with the tokens ``allowed`` [B, V] does not allow at -inf: a copy, or ``logits`` itself
    when ``allowed`` is None."""
    return logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
