"""The demo model's prefix cache: keys and values of finished sequences, reused by prompts that start the same way.

A sequence that ends leaves its tokens and their keys and values here; a new prompt takes the longest prefix any
entry shares with it and prefills only the rest, as the exllamav3 backend's page cache does (reported the same
way, as the sequence's ``cached_prompt_tokens``). An agent's next turn repeats the whole conversation so far, so it
prefills only what was added since its last answer. Keys and values at a position depend on the tokens up to it
alone, so any prefix of an entry is valid for any prompt that starts with it.

Entries are dropped least recently used first past a budget of tokens; an entry that is a prefix of a newer one is
dropped at once (the newer one answers everything it could).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    tokens: torch.Tensor  # [N] int64
    k: torch.Tensor  # [layers, H, N, D]
    v: torch.Tensor  # [layers, H, N, D]


class PrefixCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._held = 0  # tokens over all entries
        self._next_key = 0

    def match(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` and that prefix's length, at most
        ``len(prompt) - 1``: the prompt's last token is always run, since its logits give the first sampled token."""
        wanted = torch.tensor(prompt[:-1], dtype=torch.int64)  # [P - 1]
        best, best_n, best_key = None, 0, None
        for key, entry in self._entries.items():
            m = min(len(wanted), len(entry.tokens))
            differs = (wanted[:m] != entry.tokens[:m]).nonzero()
            n = int(differs[0]) if len(differs) else m
            if n > best_n:
                best, best_n, best_key = entry, n, key
        if best is not None:
            self._entries.move_to_end(best_key)
        return best, best_n

    def insert(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a finished sequence's ``tokens`` and their ``k``, ``v`` [layers, H, N, D] (copies are taken)."""
        if not tokens or len(tokens) > self.max_tokens:
            return
        new = torch.tensor(tokens, dtype=torch.int64)  # [N]
        for key in [key for key, e in self._entries.items() if len(e.tokens) <= len(new) and torch.equal(e.tokens, new[: len(e.tokens)])]:
            self._drop(key)
        self._entries[self._next_key] = Entry(new, k.clone(), v.clone())
        self._next_key += 1
        self._held += len(new)
        while self._held > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self._held -= len(self._entries.pop(key).tokens)

    def stats(self) -> dict:
        return {"prefix_cache_entries": len(self._entries), "prefix_cache_tokens": self._held}
