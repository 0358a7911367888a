"""Random walks through a grammar over the CPU demo model's vocabulary, drawn with its output prior.

This is the demo model without its network: each token is drawn among those the grammar allows, weighted as
the demo model's text prior weighs them, so a walk is what a constrained demo completion could be, at a
fraction of the cost. A walk ends where the grammar ends, at an end-of-sequence token, or at ``limit`` tokens.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from glm53.engine.constraints import CompiledGrammar, Vocabulary, unpack_masks
from glm53.engine.tiny.backend import CLOSER_WEIGHTS
from glm53.engine.tiny.model import text_prior
from glm53.engine.tiny.tokenizer import N_BYTES, ByteTokenizer

TOKENIZER = ByteTokenizer()
VOCABULARY = Vocabulary.from_token_bytes(TOKENIZER.vocabulary_bytes(), range(N_BYTES, TOKENIZER.vocab_size), TOKENIZER.eos_ids)
WEIGHTS = text_prior(TOKENIZER.vocab_size, {TOKENIZER.id_of(t): w for t, w in CLOSER_WEIGHTS.items()}).exp()  # [V]


def walk(grammar: CompiledGrammar, seed: int, limit: int = 4000) -> tuple[str, bool]:
    """(the text of one walk, whether the grammar ended it)."""
    constraint = grammar.start()
    rng = random.Random(seed)
    row = np.zeros((1, constraint.mask_words), dtype=np.int32)
    ids: list[int] = []
    while constraint.ended_at is None and len(ids) < limit:
        constraint.fill_mask(row[0])
        allowed = unpack_masks(torch.from_numpy(row), TOKENIZER.vocab_size)[0].nonzero().flatten().tolist()
        token = rng.choices(allowed, [float(WEIGHTS[i]) for i in allowed])[0]
        constraint.advance(token)
        if token in TOKENIZER.eos_ids:
            return TOKENIZER.decode(ids), True
        ids.append(token)
    assert constraint.error is None, constraint.error
    return TOKENIZER.decode(ids), constraint.ended_at is not None
