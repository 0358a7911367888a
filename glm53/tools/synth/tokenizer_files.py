"""tokenizer.json and tokenizer_config.json: a byte-level BPE with GLM-5.3's vocabulary size and special ids.

No merges: text encodes to one token per UTF-8 byte (id = byte value), which is all a random-weight model
needs, while the vocabulary still has exactly ``vocab_size`` ids so every id the model can emit decodes.
Ids 256 and up that are not GLM special tokens are filler entries ``Ġw<id>`` (decoding to `` w<id>``); the
special tokens sit at their GLM-5.3 ids both in the BPE vocabulary (the ``tokenizers`` library takes an added
token's id from the vocabulary when its text is there) and in ``added_tokens``.

A token's ``special`` flag is its ``control`` flag in the project's table: ``<think>``, ``<tool_call>`` and
the argument markers are added tokens that decoding with ``skip_special_tokens`` keeps, because the output
parsers read them, as in GLM's own tokenizer.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from glm53.models.byte_level import byte_alphabet
from glm53.models.glm_special_tokens import END_OF_TEXT, SPECIAL_TOKENS


def vocabulary(vocab_size: int) -> dict[str, int]:
    """Token text -> id for every id below ``vocab_size``: bytes, then fillers and the special tokens."""
    specials = {t.glm_id: t.text for t in SPECIAL_TOKENS}
    if max(specials) >= vocab_size:
        raise ValueError(f"vocab_size {vocab_size} cannot hold GLM's special ids (up to {max(specials)})")
    vocab = {ch: b for b, ch in enumerate(byte_alphabet())}
    for i in range(256, vocab_size):
        vocab[specials.get(i, f"Ġw{i}")] = i
    return vocab


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    added = [
        {"id": t.glm_id, "content": t.text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t.control}
        for t in SPECIAL_TOKENS
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocabulary(vocab_size),
            "merges": [],
        },
    }


def chat_template() -> str:
    """The project's built-in GLM-5 chat template (package data of ``glm53.models``)."""
    return resources.files("glm53.models").joinpath("glm5_chat_template.jinja").read_text(encoding="utf-8")


def tokenizer_config_json(max_length: int) -> dict[str, Any]:
    decoder = {
        str(t.glm_id): {"content": t.text, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": t.control}
        for t in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t.text for t in SPECIAL_TOKENS if t.control and t.text != END_OF_TEXT],
        "bos_token": None,  # GLM prompts start with [gMASK]<sop> from the template, not a BOS token
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "model_max_length": max_length,
        "padding_side": "left",
        "remove_space": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
