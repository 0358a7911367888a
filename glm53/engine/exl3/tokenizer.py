"""The checkpoint's Hugging Face tokenizer behind the ``Tokenizer`` protocol."""

from __future__ import annotations

from collections.abc import Sequence


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

    def encode(self, text: str) -> list[int]:
        # added (special) tokens written in the text are matched as such, like the chat template expects
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode([i for i in ids if i < self._size], skip_special_tokens=skip_special)
