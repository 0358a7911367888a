"""Every tensor of a synthetic checkpoint: name, dtype, shape, and how its values are made.

Names and layouts are what exllamav3 1.6.5's ``Glm5NextModel`` loads (``architecture/glm5_next.py`` and the
modules it builds; ``notes/synthetic-checkpoint.md`` has the table). Conventions:

- fp16 ``.weight`` matrices are in Hugging Face ``[out, in]`` orientation.
- An EXL3 linear is ``.trellis`` int16 ``[in/16, out/16, 16*K]`` (one 16x16 tile of K-bit codes per
  ``(in, out)`` tile), ``.suh`` fp16 ``[in]``, ``.svh`` fp16 ``[out]`` and the mul1 codebook marker ``.mul1``,
  an int32 scalar. Random trellis bits are valid codes: the mul1 codebook maps every 16-bit state to a value.
- mHC tensors are underscore-joined at the layer level (``layers.i.hc_attn_fn``), not dotted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from .presets import ModelShape, Scales
from .random_pool import RandomSource, to_bf16_bits
from .safetensors_file import Entry

PREFIX = "model.language_model"
MUL1_MARKER = 0x83DCD12D  # exllamav3 codebook_mul1_mult; stored as the int32 with the same bits
_STORAGE = {"F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4")}


def encode(values: np.ndarray, dtype: str) -> bytes:
    """Little-endian bytes of ``values`` stored as safetensors ``dtype``."""
    if dtype == "BF16":
        return to_bf16_bits(values).tobytes()
    return np.ascontiguousarray(values, dtype=_STORAGE[dtype]).tobytes()


@dataclass(frozen=True)
class RandomBits:
    """Uniform random bits: EXL3 trellis codes."""

    def chunks(self, source: RandomSource, spec: TensorSpec) -> Iterator:
        return source.bits(spec.name, spec.nbytes)


@dataclass(frozen=True)
class RandomSigns:
    """fp16 values of +-``magnitude`` with random signs: EXL3 ``suh``/``svh``."""

    magnitude: float

    def chunks(self, source: RandomSource, spec: TensorSpec) -> Iterator:
        level = np.float16(self.magnitude).view(np.uint16)
        for chunk in source.bits(spec.name, spec.nbytes):
            yield (chunk.view(np.uint16) & np.uint16(0x8000)) | level


@dataclass(frozen=True)
class Normal:
    std: float

    def chunks(self, source: RandomSource, spec: TensorSpec) -> Iterator:
        return source.normal(spec.name, math.prod(spec.shape), self.std, spec.dtype)


@dataclass(frozen=True)
class Constant:
    value: float

    def chunks(self, source: RandomSource, spec: TensorSpec) -> Iterator:
        yield encode(np.full(spec.shape, self.value, dtype=np.float64), spec.dtype)


@dataclass(frozen=True, eq=False)
class Values:
    """Values computed up front (router biases, mHC biases, the codebook marker)."""

    values: np.ndarray

    def chunks(self, source: RandomSource, spec: TensorSpec) -> Iterator:
        yield encode(self.values, spec.dtype)


@dataclass(frozen=True)
class Drawn:
    """Values from a distribution of their own: ``draw(generator, shape)``, keyed by the tensor name."""

    draw: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]

    def chunks(self, source: RandomSource, spec: TensorSpec) -> Iterator:
        yield encode(self.draw(source.generator(spec.name), spec.shape), spec.dtype)


Fill = RandomBits | RandomSigns | Normal | Constant | Values | Drawn


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    fill: Fill

    @property
    def entry(self) -> Entry:
        return Entry(self.name, self.dtype, self.shape)

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    def chunks(self, source: RandomSource) -> Iterator:
        return self.fill.chunks(source, self)


def _kda_a_log(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # Mamba-2 initialisation: per-head decay rates A = exp(A_log) uniform in [1, 16].
    return np.log(rng.uniform(1.0, 16.0, shape))


def _kda_dt_bias(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # Mamba initialisation: softplus(dt_bias) = dt log-uniform in [0.001, 0.1]; dt_bias = softplus^-1(dt).
    dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
    return dt + np.log(-np.expm1(-dt))


class _Planner:
    def __init__(self, shape: ModelShape, scales: Scales) -> None:
        self.s = shape
        self.scales = scales
        self.specs: list[TensorSpec] = []

    def add(self, name: str, dtype: str, shape: tuple[int, ...], fill: Fill) -> None:
        self.specs.append(TensorSpec(name, dtype, shape, fill))

    def exl3(self, key: str, n_in: int, n_out: int, bits: int, svh: float | None = None) -> None:
        svh = self.scales.linear_svh(n_in) if svh is None else svh
        self.add(f"{key}.trellis", "I16", (n_in // 16, n_out // 16, 16 * bits), RandomBits())
        self.add(f"{key}.suh", "F16", (n_in,), RandomSigns(1.0))
        self.add(f"{key}.svh", "F16", (n_out,), RandomSigns(svh))
        self.add(f"{key}.mul1", "I32", (), Values(np.array(MUL1_MARKER, dtype=np.uint32).view(np.int32)))

    def fp16_linear(self, key: str, n_in: int, n_out: int) -> None:
        self.add(f"{key}.weight", "F16", (n_out, n_in), Normal(self.scales.fp16_linear_std(n_in)))

    def norm(self, key: str, dim: int, dtype: str = "BF16") -> None:
        self.add(f"{key}.weight", dtype, (dim,), Constant(1.0))

    def hyper_connection(self, key: str) -> None:
        m, h = self.s.hc_mult, self.s.hidden
        base = np.zeros(2 * m + m * m, dtype=np.float32)  # [pre | post | comb (m x m)]
        base[2 * m :] = (np.eye(m) * self.scales.hc_comb_diag).ravel()
        # fn maps the RMS-normalised streams (unit RMS over m*h) to ~N(0, 1) mixing logits; scale sets their std.
        self.add(f"{key}_fn", "F32", ((2 + m) * m, m * h), Normal(1.0 / math.sqrt(m * h)))
        self.add(f"{key}_base", "F32", (2 * m + m * m,), Values(base))
        self.add(f"{key}_scale", "F32", (3,), Constant(self.scales.hc_mix_std))

    def kda(self, key: str) -> None:
        s = self.s
        width = s.kda_heads * s.kda_head_dim
        self.exl3(f"{key}.qkv_proj", s.hidden, 3 * width, s.other_bits)
        self.exl3(f"{key}.o_proj", width, s.hidden, s.other_bits)
        self.fp16_linear(f"{key}.b_proj", s.hidden, s.kda_heads)
        self.fp16_linear(f"{key}.f_a_proj", s.hidden, s.kda_head_dim)
        self.fp16_linear(f"{key}.f_b_proj", s.kda_head_dim, width)
        self.fp16_linear(f"{key}.g_a_proj", s.hidden, s.kda_head_dim)
        self.fp16_linear(f"{key}.g_b_proj", s.kda_head_dim, width)
        for part in ("q", "k", "v"):
            self.add(f"{key}.{part}_conv1d.weight", "BF16", (width, 1, s.kda_conv), Normal(self.scales.conv_std))
        self.add(f"{key}.A_log", "F32", (s.kda_heads,), Drawn(_kda_a_log))
        self.add(f"{key}.dt_bias", "BF16", (width,), Drawn(_kda_dt_bias))
        self.norm(f"{key}.o_norm", s.kda_head_dim)

    def mla(self, key: str) -> None:
        s = self.s
        self.exl3(f"{key}.q_a_proj", s.hidden, s.q_lora_rank, s.other_bits)
        self.norm(f"{key}.q_a_layernorm", s.q_lora_rank)
        self.exl3(f"{key}.q_b_proj", s.q_lora_rank, s.mla_heads * s.qk_nope_head_dim, s.other_bits)
        self.exl3(f"{key}.kv_a_proj_with_mqa", s.hidden, s.kv_lora_rank, s.other_bits)  # qk_rope_head_dim is 0
        self.norm(f"{key}.kv_a_layernorm", s.kv_lora_rank)
        self.fp16_linear(f"{key}.kv_b_proj", s.kv_lora_rank, s.mla_heads * (s.qk_nope_head_dim + s.v_head_dim))
        self.exl3(f"{key}.o_proj", s.mla_heads * s.v_head_dim, s.hidden, s.other_bits)
        idx = f"{key}.indexer"
        self.exl3(f"{idx}.wq_b", s.q_lora_rank, s.index_heads * s.index_head_dim, s.other_bits)
        self.fp16_linear(f"{idx}.wk", s.hidden, s.index_head_dim)
        self.fp16_linear(f"{idx}.weights_proj", s.hidden, s.index_heads)
        self.norm(f"{idx}.k_norm", s.index_head_dim, dtype="F16")
        self.add(f"{idx}.k_norm.bias", "F16", (s.index_head_dim,), Constant(0.0))
        self.add(f"{idx}.index_kpool_compress_ape", "BF16", (s.index_kpool, s.index_head_dim),
                 Normal(self.scales.kpool_ape_std))
        self.add(f"{idx}.index_kpool_compress_gate", "BF16", (s.index_head_dim, s.hidden),
                 Normal(self.scales.fp16_linear_std(s.hidden)))

    def gated_mlp(self, key: str, intermediate: int, bits: int, svh: float | None = None) -> None:
        s = self.s
        self.exl3(f"{key}.gate_proj", s.hidden, intermediate, bits, svh)
        self.exl3(f"{key}.up_proj", s.hidden, intermediate, bits, svh)
        self.exl3(f"{key}.down_proj", intermediate, s.hidden, bits, svh)

    def moe(self, key: str, bias: np.ndarray, gate: np.ndarray | None) -> None:
        s = self.s
        fill = Normal(self.scales.router_sigma / math.sqrt(s.hidden)) if gate is None else Values(gate)
        self.add(f"{key}.gate.weight", "F16", (s.experts, s.hidden), fill)
        self.add(f"{key}.gate.e_score_correction_bias", "F32", (s.experts,), Values(bias))
        for e in range(s.experts):
            self.gated_mlp(f"{key}.experts.{e}", s.moe_intermediate, s.expert_bits, self.scales.expert_svh)
        self.gated_mlp(f"{key}.shared_experts", s.moe_intermediate * s.shared_experts, s.other_bits)

    def layer(self, i: int, bias: np.ndarray | None, gate: np.ndarray | None) -> None:
        key = f"{PREFIX}.layers.{i}"
        self.norm(f"{key}.input_layernorm", self.s.hidden)
        self.norm(f"{key}.post_attention_layernorm", self.s.hidden)
        self.hyper_connection(f"{key}.hc_attn")
        self.hyper_connection(f"{key}.hc_ffn")
        (self.mla if self.s.is_mla(i) else self.kda)(f"{key}.self_attn")
        if self.s.is_moe(i):
            self.moe(f"{key}.mlp", bias, gate)
        else:
            self.gated_mlp(f"{key}.mlp", self.s.dense_intermediate, self.s.other_bits)


def plan(shape: ModelShape, scales: Scales, biases: dict[int, np.ndarray] | None = None,
         gates: dict[int, np.ndarray] | None = None) -> list[TensorSpec]:
    """Every tensor of the checkpoint in file order: embedding, layers 0..n-1, final norm, lm_head.

    :param biases: the router's ``e_score_correction_bias`` per MoE layer index; zeros where missing (enough
        to size the checkpoint before the biases are fitted).
    :param gates: the router's gate weight [experts, hidden] per MoE layer index (``routing.gate_weight``); where
        missing, i.i.d. normal from the random pool (the ``random`` routing).
    """
    p = _Planner(shape, scales)
    p.add(f"{PREFIX}.embed_tokens.weight", "F16", (shape.vocab, shape.hidden), Normal(scales.embed_std))
    for i in range(shape.layers):
        bias = None
        if shape.is_moe(i):
            bias = (biases or {}).get(i, np.zeros(shape.experts, dtype=np.float32))
        p.layer(i, bias, (gates or {}).get(i))
    p.norm(f"{PREFIX}.norm", shape.hidden)
    p.exl3("lm_head", shape.hidden, shape.vocab, shape.head_bits)
    return p.specs


def average_bits(shape: ModelShape) -> float:
    """Bits per weight over the EXL3 linears of the decoder layers (the head has its own ``head_bits``)."""
    weights = bits = 0
    for spec in plan(shape, Scales()):
        if spec.name.endswith(".trellis") and not spec.name.startswith("lm_head"):
            n_in, n_out, words = spec.shape[0] * 16, spec.shape[1] * 16, spec.shape[2]
            weights += n_in * n_out
            bits += n_in * n_out * words // 16
    return bits / weights
