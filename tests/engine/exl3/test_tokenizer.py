"""``HFTokenizer`` (the GPU engine's tokenizer) over a byte-level BPE like GLM's, on the CPU: the ``tokenizers``
library of the dev extra and the synthetic checkpoints' tokenizer.json (GLM-5.3's ids, no merges)."""

from __future__ import annotations

import json

import pytest

tokenizers = pytest.importorskip("tokenizers")  # the dev extra's

from glm53.engine.exl3.tokenizer import HFTokenizer  # noqa: E402
from glm53.models.glm_special_tokens import SPECIAL_TOKENS  # noqa: E402
from glm53.tools.synth.tokenizer_files import tokenizer_json  # noqa: E402

VOCAB = 154880  # GLM-5.3's model vocabulary (the tokenizer's is the same here)


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return HFTokenizer(tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json(VOCAB))), VOCAB)


@pytest.mark.parametrize("text", ["plain text", "Grüße, 世界 🎉", "a\tb\nc  d", "<think>x</think><tool_call>f</tool_call>"])
def test_token_bytes_join_to_the_texts_bytes(tok, text):
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.decode(ids) == text


def test_token_bytes_of_split_characters_specials_and_fillers(tok):
    assert [tok.token_bytes(i) for i in tok.encode("🎉")] == [b"\xf0", b"\x9f", b"\x8e", b"\x89"]
    assert tok.token_bytes(tok.encode(" ")[0]) == b" "  # byte 32 is the alphabet's 'Ġ'
    think = next(t for t in SPECIAL_TOKENS if t.text == "<think>")
    assert tok.token_bytes(think.glm_id) == b"<think>"
    assert tok.token_bytes(300) == b" w300"  # a filler entry 'Ġw300'
