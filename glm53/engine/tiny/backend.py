"""The CPU demo backend (``--engine tiny``): TinyGLM behind the ``Backend`` contract.

Every serving path runs for real on it: chunked prefill, one batched decode forward over all sequences
(each sequence's KV cache is one slot of a shared pool), per-sequence sampling, logprobs, grammar constraints and
teacher-forced scoring. The weights come from a seed, so two backends with the same seed give the same outputs.
A sequence that ends leaves its keys and values in a prefix cache (``prefix_cache.py``): a prompt that starts the
same way prefills only the rest and reports the tokens it was spared as cached.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from glm53.engine.constraints import Constraint, MaskWorker, Vocabulary, apply_masks
from glm53.engine.interface import (
    LogprobRequest,
    ModelInfo,
    SampledToken,
    SamplingParams,
    TokenLogprobs,
)
from glm53.engine.sampling import logprobs_for, sample
from glm53.engine.tiny.model import TinyConfig, TinyGLM, text_prior
from glm53.engine.tiny.prefix_cache import PrefixCache
from glm53.engine.tiny.tokenizer import N_BYTES, ByteTokenizer
from glm53.models.glm_special_tokens import END_OF_TEXT

# Weights of the tokens that end something, next to the letters' (percent of English text): at temperature 1 a
# completion ends after a few hundred tokens on average, its think block after about a hundred, and a tool-call
# argument held to a grammar after about a hundred characters.
CLOSER_WEIGHTS = {END_OF_TEXT: 0.3, "</think>": 1.0, "</arg_value>": 1.5}


@dataclass
class _Sequence:
    prompt: list[int]
    sampling: SamplingParams
    logprobs: LogprobRequest | None
    slot: int  # where its keys and values live in the backend's pool
    generator: torch.Generator
    counts: torch.Tensor | None  # [V] tokens generated so far; kept only when a penalty needs them
    constraint: Constraint | None = None  # the grammar its tokens must follow
    pending: int | None = None  # the last sampled token, fed to the model in the next step
    sampled: list[int] = field(default_factory=list)  # every token sampled so far, the pending one last
    cached: int = 0  # prompt tokens taken from the prefix cache


class TinyBackend:
    def __init__(self, context_length: int, max_batch_size: int, chunk_size: int, seed: int = 0,
                 prefix_cache_tokens: int | None = None) -> None:
        """
        :param context_length: most tokens one sequence may hold.
        :param max_batch_size: most sequences active at once.
        :param chunk_size: most prompt tokens prefilled per step (over all sequences), and the chunk size
            of ``score``.
        :param seed: the weights' seed.
        :param prefix_cache_tokens: most tokens the prefix cache keeps (None: one context's worth; at the demo's
            size a token's keys and values take 1.5 KB).
        """
        self.tokenizer = ByteTokenizer()
        # every id past the bytes is a special token: grammars match it whole, never spelled in bytes
        self.vocabulary = Vocabulary.from_token_bytes(
            self.tokenizer.vocabulary_bytes(), range(N_BYTES, self.tokenizer.vocab_size), self.tokenizer.eos_ids)
        cfg = TinyConfig(vocab_size=self.tokenizer.vocab_size)
        self.model = TinyGLM(cfg, seed, text_prior(cfg.vocab_size, {self.tokenizer.id_of(t): w for t, w in CLOSER_WEIGHTS.items()}))
        self.context_length = context_length
        self.max_batch_size = max_batch_size
        self.chunk_size = chunk_size
        self.info = ModelInfo(
            name="glm53-tiny",
            architecture="TinyGLM (CPU demo)",
            context_length=context_length,
            vocab_size=cfg.vocab_size,
            eos_token_ids=self.tokenizer.eos_ids,
            checkpoint_dir=None,  # no checkpoint, so the server's built-in GLM-5 template applies
            facts=_facts(self.model, seed),
        )
        self._pool = self.model.new_pool(max_batch_size, context_length)
        self._free_slots = set(range(max_batch_size))
        self._sequences: dict[int, _Sequence] = {}  # in order of arrival, which is also the prefill order
        self._masks = MaskWorker(cfg.vocab_size)
        self._prefixes = PrefixCache(context_length if prefix_cache_tokens is None else prefix_cache_tokens)
        self._counters = dict(steps=0, prefill_tokens=0, decode_tokens=0, scored_tokens=0)

    def add(self, seq_id: int, prompt_ids: Sequence[int], sampling: SamplingParams, logprobs: LogprobRequest | None = None,
            constraint: Constraint | None = None) -> None:
        """Start a sequence. :raise ValueError: duplicate id, batch full, bad prompt length or token id."""
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id} is already active")
        if len(self._sequences) >= self.max_batch_size:
            raise ValueError(f"the batch is full ({self.max_batch_size} sequences)")
        prompt = self._checked(prompt_ids)
        if len(prompt) >= self.context_length:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in the context ({self.context_length})")
        generator = torch.Generator()
        if sampling.seed is None:
            generator.seed()  # fresh entropy, so unseeded sequences do not share a stream
        else:
            generator.manual_seed(sampling.seed)
        penalised = sampling.presence_penalty != 0 or sampling.frequency_penalty != 0
        counts = torch.zeros(self.info.vocab_size) if penalised else None  # [V]
        # The lowest free slot keeps the active slots packed, so decode batches stay views of the pool.
        slot = min(self._free_slots)
        self._free_slots.remove(slot)
        seq = _Sequence(prompt, sampling, logprobs, slot, generator, counts, constraint)
        entry, seq.cached = self._prefixes.match(prompt)
        if entry is not None:
            # the pool may have been made by a step's forward: an inference tensor, written only in inference mode
            with torch.inference_mode():
                self._pool.reserve(seq.cached)
                self._pool.k[:, slot, :, : seq.cached] = entry.k[:, :, : seq.cached]
                self._pool.v[:, slot, :, : seq.cached] = entry.v[:, :, : seq.cached]
            self._pool.lengths[slot] = seq.cached
        self._sequences[seq_id] = seq

    def remove(self, seq_id: int) -> None:
        """Forget the sequence; what its slot holds (the prompt and every fed token) goes to the prefix cache."""
        seq = self._sequences.pop(seq_id, None)
        if seq is not None:
            held = self._pool.lengths[seq.slot]
            if held:
                k, v = self._pool.k[:, seq.slot, :, :held], self._pool.v[:, seq.slot, :, :held]  # [L, H, N, D] each
                self._prefixes.insert((seq.prompt + seq.sampled)[:held], k, v)
            self._pool.free(seq.slot)
            self._free_slots.add(seq.slot)

    def step(self) -> dict[int, list[SampledToken]]:
        """Decode every sequence that has a pending token (one batched forward), then prefill prompts with
        at most ``chunk_size`` tokens; a sequence whose prompt completes here gets its first token."""
        with torch.inference_mode():
            produced = self._decode()
            produced.update(self._prefill())
        self._counters["steps"] += 1
        return produced

    def _decode(self) -> dict[int, list[SampledToken]]:
        batch = sorted(
            ((seq_id, seq) for seq_id, seq in self._sequences.items() if seq.pending is not None),
            key=lambda item: item[1].slot,
        )
        if not batch:
            return {}
        tokens = torch.tensor([[seq.pending] for _, seq in batch])  # [B, 1]
        masks = self._masks.start([seq.constraint for _, seq in batch])  # computed while the forward runs
        logits = self.model(tokens, self._pool, [seq.slot for _, seq in batch])  # [B, V]
        self._counters["decode_tokens"] += len(batch)
        return self._sample(batch, logits, masks.result())

    def _prefill(self) -> dict[int, list[SampledToken]]:
        produced: dict[int, list[SampledToken]] = {}
        budget = self.chunk_size
        for seq_id, seq in self._sequences.items():
            if budget == 0:
                break
            start = self._pool.lengths[seq.slot]
            if start >= len(seq.prompt):
                continue
            chunk = seq.prompt[start : start + budget]  # [T]
            budget -= len(chunk)
            self._counters["prefill_tokens"] += len(chunk)
            finishes = start + len(chunk) == len(seq.prompt)
            # Only the prompt's last position predicts anything wanted; the LM head runs on nothing else.
            logits_at = torch.tensor([len(chunk) - 1] if finishes else [], dtype=torch.int64)
            masks = self._masks.start([seq.constraint] if finishes else [])
            logits = self.model(torch.tensor([chunk]), self._pool, [seq.slot], logits_at)  # [1 or 0, V]
            if finishes:
                produced.update(self._sample([(seq_id, seq)], logits, masks.result()))
        return produced

    def _sample(self, batch: list[tuple[int, _Sequence]], logits: torch.Tensor, allowed: torch.Tensor | None) -> dict[int, list[SampledToken]]:
        """Pick each row's token from ``logits`` [B, V], among the tokens ``allowed`` [B, V] (None: all), and make
        it the row's pending token. Logprobs stay those of the raw logits."""
        seqs = [seq for _, seq in batch]
        masked = apply_masks(logits, allowed)
        chosen = sample(masked, [s.sampling for s in seqs], [s.generator for s in seqs], [s.counts for s in seqs])
        produced = {}
        for (seq_id, seq), token, row in zip(batch, chosen.tolist(), logits):
            first = not seq.sampled
            seq.pending = token
            seq.sampled.append(token)
            if seq.constraint is not None:
                seq.constraint.advance(token)
            if seq.counts is not None:
                seq.counts[token] += 1
            logprobs = logprobs_for(row, token, seq.logprobs) if seq.logprobs is not None else None
            produced[seq_id] = [SampledToken(token, logprobs, seq.cached if first else 0)]
        return produced

    def score(self, ids: Sequence[int], start: int, request: LogprobRequest) -> Iterator[list[TokenLogprobs | None] | None]:
        """Teacher-forced logprobs of ``ids[start:]``, in chunks of ``chunk_size`` positions; touches no
        sequence's cache. :raise ValueError: (at the call) empty or too long ``ids``, ``start`` out of range,
        a token id outside the vocabulary."""
        ids = self._checked(ids)
        if len(ids) > self.context_length:
            raise ValueError(f"{len(ids)} tokens exceed the context length ({self.context_length})")
        if not 0 <= start <= len(ids):
            raise ValueError(f"start {start} is outside 0..{len(ids)}")
        return self._score(ids, start, request)

    def _score(self, ids: list[int], start: int, request: LogprobRequest) -> Iterator[list[TokenLogprobs | None] | None]:
        pool = self.model.new_pool(1, self.context_length)
        entries: list[TokenLogprobs | None] = [None] if start == 0 else []
        first = max(start, 1) - 1  # the first position whose logits are wanted: it predicts ids[first + 1]
        # The last token predicts nothing that was asked for, so the forward stops before it.
        for a in range(0, len(ids) - 1, self.chunk_size):
            b = min(a + self.chunk_size, len(ids) - 1)
            # [N] positions whose logits are needed; those before `first` only fill the cache
            wanted = torch.arange(min(max(first, a), b), b)
            with torch.inference_mode():
                logits = self.model(torch.tensor([ids[a:b]]), pool, [0], wanted - a)  # [N, V]
                if len(wanted):
                    entries.extend(logprobs_for(logits, [ids[q + 1] for q in wanted.tolist()], request))
            self._counters["scored_tokens"] += b - a
            yield None
        yield entries

    def _checked(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        if not ids:
            raise ValueError("no tokens given")
        bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.info.vocab_size - 1})")
        return ids

    def stats(self) -> dict:
        return {
            **self._counters,
            **self._prefixes.stats(),
            "active_sequences": len(self._sequences),
            # Routed-expert choices so far, one list (indexed by expert) per MoE layer.
            "expert_selections": [layer.selections.tolist() for layer in self.model.moe_layers],
        }

    def close(self) -> None:
        self._prefixes = PrefixCache(0)  # nothing that ends now is worth keeping
        for seq_id in list(self._sequences):
            self.remove(seq_id)
        self._masks.close()


def _facts(model: TinyGLM, seed: int) -> dict[str, object]:
    cfg = model.cfg
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "hidden": cfg.hidden,
        "layers": cfg.n_layers,
        "dense_layers": cfg.n_dense_layers,
        "heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "routed_experts": cfg.n_experts,
        "experts_per_token": cfg.top_k,
        "shared_experts": 1,
        "seed": seed,
    }
