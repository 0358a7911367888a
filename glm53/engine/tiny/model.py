"""TinyGLM: a small GLM-style mixture-of-experts transformer with random weights, for the CPU demo backend.

The shape of the computation is GLM's (RMSNorm, rotary attention, a dense first layer, then MoE layers with
sigmoid routing, a selection-only correction bias, normalised and scaled expert weights, clamped SwiGLU
experts and a shared expert); the sizes are tiny and the weights come from a seeded generator, so the model
is deterministic, needs no file, and its output is gibberish shaped by an output prior towards ASCII text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int
    hidden: int = 64
    n_heads: int = 4
    head_dim: int = 16
    n_layers: int = 3
    n_dense_layers: int = 1  # the first layers use a dense MLP, the rest MoE (as in GLM)
    n_experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 64  # routed and shared experts
    dense_intermediate: int = 128
    routed_scaling_factor: float = 2.5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def _normal(g: torch.Generator, *shape: int, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=g) * std, requires_grad=False)


def _linear(g: torch.Generator, n_in: int, n_out: int, scale: float = 1.0) -> nn.Parameter:
    """Weight [n_out, n_in] whose outputs have about ``scale`` times the RMS of its inputs."""
    return _normal(g, n_out, n_in, std=scale / math.sqrt(n_in))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` [B, T, H, D] at ``positions`` [B, T] (rotate-half layout)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32) / half)  # [D/2]
    # Angles are made from the positions each time, not from a table: a table for a 128k context would
    # dwarf the model, and the product is the same per element in any batch.
    angles = positions[:, :, None, None].float() * inv_freq  # [B, T, 1, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig, g: torch.Generator, layer: int, out_scale: float) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer  # which of the pool's layers holds this attention's keys and values
        width = cfg.n_heads * cfg.head_dim
        self.qkv = _linear(g, cfg.hidden, 3 * width)  # [3 * H * D, hidden]
        self.out = _linear(g, width, cfg.hidden, out_scale)  # [hidden, H * D]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Attend from ``x`` [B, T, hidden] over the batch's sequences, this chunk included: [B, T, hidden]."""
        B, T, _ = x.shape
        H, D = self.cfg.n_heads, self.cfg.head_dim
        q, k, v = (x @ self.qkv.T).view(B, T, 3, H, D).unbind(dim=2)  # [B, T, H, D] each
        q = rotate(q, batch.positions, self.cfg.rope_theta)
        k = rotate(k, batch.positions, self.cfg.rope_theta)
        keys, values = batch.store(self.layer, k, v)  # [B, H, S, D] each
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=batch.mask)  # [B, H, T, D]
        return y.transpose(1, 2).reshape(B, T, H * D) @ self.out.T  # [B, T, hidden]


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SiLU(gate) * up; with ``limit``, GLM's clamp first: gate to at most ``limit``, up to +-``limit``."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


class MLP(nn.Module):
    """A SwiGLU MLP: the dense layers' MLP and the shared expert."""

    def __init__(self, hidden: int, intermediate: int, g: torch.Generator, out_scale: float, limit: float | None) -> None:
        super().__init__()
        self.gate_up = _linear(g, hidden, 2 * intermediate)  # [2 * I, hidden]
        self.down = _linear(g, intermediate, hidden, out_scale)  # [hidden, I]
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up.T).chunk(2, dim=-1)  # [..., I] each
        return swiglu(gate, up, self.limit) @ self.down.T


class MoE(nn.Module):
    """GLM's MoE MLP: sigmoid-scored top-k routed experts plus an always-on shared expert."""

    def __init__(self, cfg: TinyConfig, g: torch.Generator, out_scale: float) -> None:
        super().__init__()
        self.cfg = cfg
        E, I, hidden = cfg.n_experts, cfg.expert_intermediate, cfg.hidden
        self.router = _linear(g, hidden, E)  # [E, hidden]
        self.e_score_correction_bias = nn.Parameter(torch.randn(E, generator=g) * 0.1, requires_grad=False)  # [E]
        self.gate_up = _normal(g, E, hidden, 2 * I, std=1 / math.sqrt(hidden))  # [E, hidden, 2 * I]
        # The routed weights add up to routed_scaling_factor; dividing it out of the experts keeps the sum O(1).
        self.down = _normal(g, E, I, hidden, std=out_scale / cfg.routed_scaling_factor / math.sqrt(I))  # [E, I, hidden]
        self.shared = MLP(hidden, I, g, out_scale, cfg.swiglu_limit)
        self.register_buffer("selections", torch.zeros(E, dtype=torch.int64), persistent=False)  # [E]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts and weights for each token of ``x`` [N, hidden]: ([N, k] ids, [N, k] float32 weights).

        The correction bias steers which experts are chosen but not how much each counts: the weights are
        the chosen experts' own sigmoid scores, normalised to sum to 1, times ``routed_scaling_factor``.
        """
        scores = torch.sigmoid(x @ self.router.T)  # [N, E]
        chosen = (scores + self.e_score_correction_bias).topk(self.cfg.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(1, chosen)  # [N, k]
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.cfg.routed_scaling_factor
        return chosen, weights

    def experts(self, x: torch.Tensor) -> torch.Tensor:
        """Every routed expert applied to every token of ``x`` [N, hidden]: [E, N, hidden]."""
        gate, up = torch.einsum("nh,ehi->eni", x, self.gate_up).chunk(2, dim=-1)  # [E, N, I] each
        return torch.bmm(swiglu(gate, up, self.cfg.swiglu_limit), self.down)  # [E, N, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, hidden]
        chosen, weights = self.route(x)
        self.selections += torch.bincount(chosen.flatten(), minlength=self.cfg.n_experts)
        # With 8 experts this small, running all of them in two batched matmuls is faster on a CPU than
        # gathering each expert's tokens; an unchosen expert gets weight exactly 0, so the sum equals the
        # sparse one. The clamp keeps every expert output finite, so 0 * output is always 0.
        combine = torch.zeros(x.shape[0], self.cfg.n_experts).scatter_(1, chosen, weights)  # [N, E]
        routed = torch.einsum("ne,enh->nh", combine, self.experts(x))  # [N, hidden]
        return (routed + self.shared(x)).view(shape)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig, g: torch.Generator, layer: int) -> None:
        super().__init__()
        # GPT-2's residual scaling: each of the 2 * n_layers sublayers adds a share of the stream's variance.
        out_scale = 1 / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, g, layer, out_scale)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        if layer < cfg.n_dense_layers:
            self.mlp: nn.Module = MLP(cfg.hidden, cfg.dense_intermediate, g, out_scale, None)
        else:
            self.mlp = MoE(cfg, g, out_scale)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), batch)
        return x + self.mlp(self.mlp_norm(x))


class KVPool:
    """Keys and values of up to ``slots`` sequences, one slot each: ``k``, ``v`` [layers, slots, H, capacity, D].

    The slots share one capacity, grown in whole pages as the longest sequence needs it. Because every
    sequence sits at the same place in its slot, a batch of sequences in consecutive slots is a view of the
    pool, padding included: a decode step reads the caches where they are instead of copying each
    sequence's past into a padded batch (measured: that copy took about a third of a 16-sequence step).
    """

    PAGE = 256  # tokens

    def __init__(self, cfg: TinyConfig, slots: int, max_tokens: int) -> None:
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.lengths = [0] * slots  # tokens held in each slot
        self._allocate(0)

    def _allocate(self, capacity: int) -> None:
        cfg = self.cfg
        shape = (cfg.n_layers, len(self.lengths), cfg.n_heads, capacity, cfg.head_dim)  # [L, slots, H, cap, D]
        # Zeros, not empty(): masked padding is multiplied by an attention weight of 0 and must be finite.
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, n: int) -> None:
        """Make room for ``n`` tokens per slot. :raise ValueError: ``n`` is beyond ``max_tokens``."""
        if n > self.max_tokens:
            raise ValueError(f"a sequence of {n} tokens exceeds the context length ({self.max_tokens})")
        if n <= self.capacity:
            return
        old_k, old_v = self.k, self.v
        # At least twofold growth keeps the copying of a growing sequence linear in its length.
        pages = -(-max(n, 2 * self.capacity) // self.PAGE)
        self._allocate(min(pages * self.PAGE, self.max_tokens))
        self.k[:, :, :, : old_k.shape[3]] = old_k
        self.v[:, :, :, : old_v.shape[3]] = old_v

    def free(self, slot: int) -> None:
        """Forget the slot's tokens; when no slot holds any, give the memory back."""
        self.lengths[slot] = 0
        if not any(self.lengths):
            self._allocate(0)


@dataclass
class Batch:
    """One forward's sequences: their pool slots, the positions of their new tokens, what each query sees."""

    pool: KVPool
    slots: torch.Tensor  # [B, 1] slot of each row
    rows: slice | torch.Tensor  # the same slots; a slice when consecutive, so reading them is a view
    positions: torch.Tensor  # [B, T] position of each new token
    mask: torch.Tensor  # [B, 1, T, S] bool: key s is visible to query t (causal; padding hidden)

    @classmethod
    def of(cls, pool: KVPool, slots: list[int], T: int) -> Batch:
        lengths = torch.tensor([pool.lengths[slot] for slot in slots])  # [B]
        positions = lengths[:, None] + torch.arange(T)  # [B, T]
        keys = torch.arange(int(positions.max()) + 1)  # [S]: up to the longest row; shorter rows are padded
        mask = keys[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        rows = slice(slots[0], slots[0] + len(slots)) if consecutive else torch.tensor(slots)
        return cls(pool, torch.tensor(slots)[:, None], rows, positions, mask)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put this chunk's ``k``, ``v`` [B, T, H, D] in the pool; return every row's keys and values up to
        the longest row, [B, H, S, D] each."""
        S = self.mask.shape[-1]
        # Indexing [slots, H, cap, D] by ([B, 1], :, [B, T]) addresses a [B, T, H, D] block.
        self.pool.k[layer][self.slots, :, self.positions] = k
        self.pool.v[layer][self.slots, :, self.positions] = v
        return self.pool.k[layer][self.rows, :, :S], self.pool.v[layer][self.rows, :, :S]


class TinyGLM(nn.Module):
    def __init__(self, cfg: TinyConfig, seed: int, output_prior: torch.Tensor) -> None:
        """Weights drawn from ``seed``; ``output_prior`` [V] is the LM head's bias (see ``text_prior``)."""
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)
        self.embed = _normal(g, cfg.vocab_size, cfg.hidden, std=1.0)  # [V, hidden]
        self.blocks = nn.ModuleList(Block(cfg, g, layer) for layer in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        # Context-dependent logits of about unit spread on top of the prior: enough to make the output
        # depend on the prompt, too little to drown the prior's preference for text.
        self.lm_head = _linear(g, cfg.hidden, cfg.vocab_size)  # [V, hidden]
        self.lm_bias = nn.Parameter(output_prior.float().clone(), requires_grad=False)  # [V]

    @property
    def moe_layers(self) -> list[MoE]:
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]

    def new_pool(self, slots: int, max_tokens: int) -> KVPool:
        return KVPool(self.cfg, slots, max_tokens)

    def forward(self, tokens: torch.Tensor, pool: KVPool, slots: list[int], logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Run the next T tokens of B sequences and append them to the sequences' slots in ``pool``.

        :param tokens: [B, T] int64, row b continuing the sequence in ``slots[b]``.
        :param logits_at: indices into the B * T flattened positions whose logits are wanted; None: all.
        :return: [N, V] float32 logits, N = len(logits_at) (or B * T).
        :raise ValueError: a sequence would grow beyond the pool's ``max_tokens``.
        """
        B, T = tokens.shape
        pool.reserve(max(pool.lengths[slot] for slot in slots) + T)
        batch = Batch.of(pool, slots, T)
        x = F.embedding(tokens, self.embed)  # [B, T, hidden]
        for block in self.blocks:
            x = block(x, batch)
        for slot in slots:
            pool.lengths[slot] += T
        x = x.reshape(B * T, -1)  # [B * T, hidden]
        if logits_at is not None:
            x = x[logits_at]  # [N, hidden]
        return self.norm(x) @ self.lm_head.T + self.lm_bias  # [N, V]


# Relative frequencies (%) of letters in English text: bytes drawn by them spell pronounceable gibberish.
_LETTERS = dict(
    e=12.7, t=9.1, a=8.2, o=7.5, i=7.0, n=6.7, s=6.3, h=6.1, r=6.0, d=4.3, l=4.0, c=2.8, u=2.8,
    m=2.4, w=2.4, f=2.2, g=2.0, y=2.0, p=1.9, b=1.5, v=1.0, k=0.8, j=0.15, x=0.15, q=0.1, z=0.07,
)  # fmt: skip


def text_prior(vocab_size: int, closers: Mapping[int, float]) -> torch.Tensor:
    """LM-head bias [V] that makes the output read like words: log of relative token weights.

    Ids below 256 are bytes (the demo tokenizer's layout), the rest special tokens. Letters follow English
    frequencies, space separates words, newlines and punctuation are occasional; other bytes and special
    tokens are very unlikely. The characters that close JSON strings, objects and arrays are as common as
    punctuation, and ``closers`` (special token id -> weight, in the same units as the letters: percent) gives
    the tokens that end a completion or a structure theirs: output held to a grammar (engine/constraints.py)
    then closes what it opens within tens of tokens, as a real model's does.
    """
    weights = torch.full((vocab_size,), 1e-6)  # [V]
    for char in "0123456789-:;!?()'\"":
        weights[ord(char)] = 0.1
    for letter, percent in _LETTERS.items():
        weights[ord(letter)] = percent
        weights[ord(letter.upper())] = percent / 50
    weights[ord(" ")] = 30.0
    weights[ord(",")] = weights[ord(".")] = 1.0
    weights[ord("\n")] = 0.8
    weights[ord('"')] = 3.0
    weights[ord("}")] = weights[ord("]")] = 2.0
    for token, weight in closers.items():
        weights[token] = weight
    return weights.log()
