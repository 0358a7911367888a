"""A scripted backend for scheduler and server tests: each sequence emits a given token list, then EOS."""

from __future__ import annotations

from collections.abc import Sequence

from glm53.engine.interface import LogprobRequest, ModelInfo, SampledToken, SamplingParams, TokenLogprobs

EOS = 256


class ByteTokens:
    """Bytes are ids 0..255; 256 is EOS (text '<eos>')."""

    vocab_size = 257
    special_ids = frozenset({EOS})

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i == EOS:
                out.append(buf.decode(errors="replace"))
                buf = bytearray()
                if not skip_special:
                    out.append("<eos>")
            else:
                buf.append(i)
        out.append(buf.decode(errors="replace"))
        return "".join(out)


class ScriptedBackend:
    """Sequence i emits ``script(prompt_ids)`` one token per step (after a prefill step), then EOS forever."""

    def __init__(self, script=None, max_batch_size: int = 4, context_length: int = 4096, fail_on_step: int | None = None):
        self.tokenizer = ByteTokens()
        self.info = ModelInfo("scripted", "test", context_length, 257, frozenset({EOS}))
        self.max_batch_size = max_batch_size
        self._script = script or (lambda prompt: list(b"hello world"))
        self.seqs: dict[int, list[int]] = {}
        self.added: list[int] = []
        self.removed: list[int] = []
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.max_active = 0

    def add(self, seq_id: int, prompt_ids: Sequence[int], sampling: SamplingParams, logprobs: LogprobRequest | None = None) -> None:
        if seq_id in self.seqs:
            raise ValueError("duplicate")
        if prompt_ids and prompt_ids[0] == 0:
            raise ValueError("prompts starting with byte 0 are refused (test hook)")
        self.seqs[seq_id] = [-1] + list(self._script(list(prompt_ids)))  # -1: the prefill step yields nothing
        self.added.append(seq_id)
        self.max_active = max(self.max_active, len(self.seqs))

    def remove(self, seq_id: int) -> None:
        if self.seqs.pop(seq_id, None) is not None:
            self.removed.append(seq_id)

    def step(self) -> dict[int, list[SampledToken]]:
        self.steps += 1
        if self.fail_on_step == self.steps:
            raise RuntimeError("injected step failure")
        out = {}
        for seq_id, queue in self.seqs.items():
            tok = queue.pop(0) if queue else EOS
            if tok != -1:
                out[seq_id] = [SampledToken(tok, TokenLogprobs(-0.5, ((tok, -0.5),)))]
        return out

    def score(self, ids, start, request):
        yield None
        yield [None if p == 0 else TokenLogprobs(-1.0 * p) for p in range(start, len(ids))]

    def stats(self) -> dict:
        return {"steps": self.steps}

    def close(self) -> None:
        pass
