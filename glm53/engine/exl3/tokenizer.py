"""The checkpoint's Hugging Face tokenizer behind the ``Tokenizer`` protocol."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import decoders

from ...models.byte_level import byte_alphabet

_BYTE_OF = {ch: b for b, ch in enumerate(byte_alphabet())}


class HFTokenizer:
    def __init__(self, hf_tokenizer, model_vocab_size: int):
        """
        :param hf_tokenizer: a ``tokenizers.Tokenizer`` (exllamav3's Tokenizer loads one from tokenizer.json).
        :param model_vocab_size: the model's vocabulary; ids past the tokenizer's own are padding and decode to "".
        """
        self._tok = hf_tokenizer
        self._size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = model_vocab_size
        self.special_ids = frozenset(i for i, t in hf_tokenizer.get_added_tokens_decoder().items() if t.special)
        self._added = frozenset(hf_tokenizer.get_added_tokens_decoder())
        # GLM's tokenizer is a byte-level BPE: its token strings spell bytes in GPT-2's alphabet
        self._byte_level = isinstance(hf_tokenizer.decoder, decoders.ByteLevel)

    def encode(self, text: str) -> list[int]:
        # added (special) tokens written in the text are matched as such, like the chat template expects
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode([i for i in ids if i < self._size], skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id >= self._size:
            return b""  # padding ids of the model's vocabulary decode to nothing
        if token_id in self._added or not self._byte_level:
            return self._tok.decode([token_id], skip_special_tokens=False).encode()
        return bytes(_BYTE_OF[ch] for ch in self._tok.id_to_token(token_id))
