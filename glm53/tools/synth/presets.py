"""The shapes of the synthetic checkpoints (one table) and the scales of their random values (one place).

``full`` and ``scaled`` have GLM-5.3-Flash's real per-layer shapes; ``scaled`` just stops after fewer MoE
layers. ``tiny`` shrinks what exllamav3 1.6.5 lets shrink and keeps what its kernels fix:

- MLA latent widths (``kv_lora_rank`` 512, ``qk_nope_head_dim`` 256, ``v_head_dim`` 256): the Triton MLA
  kernels index with ``tl.arange`` over them, and the graph path (``attention_fn/bc_mla.py``) requires
  powers of two with the latent a multiple of 128.
- KDA ``head_dim`` 128 and the indexer's ``index_head_dim`` 128 (a power of two in ``bc_mla.py``).
- Every linear width a multiple of 128 (the Hadamard blocks and kernel tiles of EXL3).
- ``hc_mult`` 4: the fused mHC kernels only exist for four streams.
- The vocabulary (154880): GLM's special tokens sit at ids above 154000.

Head counts, ``hidden_size``, ``q_lora_rank``, the MLP widths and the expert count are free parameters there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

N_DENSE = 3  # GLM-5.3-Flash: the first three layers have a dense MLP, the rest are MoE
MLA_EVERY = 4  # layer i is MLA/DSA where i % 4 == 3, KDA otherwise
REAL_MOE_LAYERS = 42


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    vocab: int
    moe_layers: int
    # MLA with the DSA indexer
    mla_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    # KDA linear attention
    kda_heads: int
    kda_head_dim: int
    kda_conv: int
    # MLPs
    dense_intermediate: int
    moe_intermediate: int
    experts: int
    top_k: int
    shared_experts: int
    # EXL3 bits per weight
    expert_bits: int = 3
    other_bits: int = 4
    head_bits: int = 6
    hc_mult: int = 4

    @property
    def layers(self) -> int:
        return N_DENSE + self.moe_layers

    def is_mla(self, layer: int) -> bool:
        return layer % MLA_EVERY == MLA_EVERY - 1

    def is_moe(self, layer: int) -> bool:
        return layer >= N_DENSE

    @property
    def moe_layer_indices(self) -> list[int]:
        return list(range(N_DENSE, self.layers))


@dataclass(frozen=True)
class Scales:
    """Standard deviations and magnitudes of the random values, chosen so activations stay O(1) in every layer.

    Every sublayer (attention, MLP) reads an RMS-normalised input with unit RMS. A linear whose weight RMS is
    ``1/sqrt(in)`` then keeps unit RMS; an EXL3 weight's RMS is about ``|suh| * |svh|`` (the mul1 codebook
    decodes random bits to values of RMS ~1 and the Hadamard rotations are orthonormal), hence
    ``svh = 1/sqrt(in)`` for the non-expert linears. Experts use ``expert_svh`` 0.02 (notes: realistic for a
    3-bit conversion; gain 0.02*sqrt(4096) = 1.3 into the intermediate, 0.9 back out). A MoE layer adds about
    2.5 * sqrt(8)/8 * O(1) from the routed experts plus O(1) from the shared one, so each sublayer adds O(1).

    The mHC streams carry the residual: each site updates ``x <- post * y + comb^T x`` where ``comb`` is
    doubly stochastic (never amplifies) and ``post = 2 sigmoid(.)`` lies in (0, 2); with mixing logits of std
    ``hc_mix_std`` around zero, ``post`` is ~1 and the streams grow like a plain residual: RMS ~ sqrt(number of
    sublayers), about 10 after 45 layers, well inside fp16 for the collapsed input that is normalised anyway.
    ``hc_comb_diag`` biases the Sinkhorn mix towards each stream keeping itself (0.71 on the diagonal at
    zero noise), so the four streams stay distinct instead of collapsing into one after the first layer.

    The router's gate has std ``router_sigma/sqrt(hidden)``, so on the unit-RMS post-attention norm its
    logits are ~N(0, router_sigma^2), the distribution the bias fit assumes.
    """

    expert_svh: float = 0.02
    embed_std: float = 1.0  # the streams start at about one sublayer's worth of RMS
    router_sigma: float = 1.0
    hc_mix_std: float = 0.5
    hc_comb_diag: float = 2.0
    conv_std: float = 0.3  # KDA short convolutions: 4 taps, output RMS ~0.6 before SiLU
    kpool_ape_std: float = 0.02

    def linear_svh(self, n_in: int) -> float:
        return 1.0 / math.sqrt(n_in)

    def fp16_linear_std(self, n_in: int) -> float:
        return 1.0 / math.sqrt(n_in)


SCALES = Scales()

_REAL = ModelShape(
    hidden=4096,
    vocab=154880,
    moe_layers=REAL_MOE_LAYERS,
    mla_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    v_head_dim=256,
    index_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_kpool=4,
    kda_heads=64,
    kda_head_dim=128,
    kda_conv=4,
    dense_intermediate=12288,
    moe_intermediate=2048,
    experts=288,
    top_k=8,
    shared_experts=1,
)

PRESETS: dict[str, ModelShape] = {
    "full": _REAL,
    "scaled": dataclasses.replace(_REAL, moe_layers=12),
    # 8 layers: dense 0-2, MoE 3-7, MLA at 3 and 7. About 0.5 GB, dominated by the real-vocabulary embedding.
    "tiny": dataclasses.replace(
        _REAL,
        hidden=1024,
        moe_layers=5,
        mla_heads=16,
        q_lora_rank=768,
        kda_heads=16,
        dense_intermediate=2048,
        moe_intermediate=512,
        experts=16,
        top_k=4,
    ),
}


def resolve(preset: str, moe_layers: int | None = None) -> ModelShape:
    """The shape of ``preset``, with ``moe_layers`` MoE layers after the three dense ones if given.

    :raise ValueError: an unknown preset, or fewer than one MoE layer.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    shape = PRESETS[preset]
    if moe_layers is None:
        return shape
    if moe_layers < 1:
        raise ValueError(f"--moe-layers must be at least 1, got {moe_layers}")
    return dataclasses.replace(shape, moe_layers=moe_layers)


# Routing presets (``glm53 synth --routing``): the dynamics ``routing`` implements, and the figures
# ``bench.routing_stats`` must measure on a preset's twin for the preset to be accepted.
BAND_EXPERTS, BAND_TOP_K = 288, 8  # the routing shape the presets' bands are stated at (GLM-5.3-Flash's)


@dataclass(frozen=True)
class Dynamics:
    temporal: float  # lag-1 correlation over tokens of each layer's routing state
    layer_carry: float  # correlation of consecutive MoE layers' routing states
    rank: int  # width of the routing subspace every gate reads

    def __post_init__(self):
        if not (0.0 <= self.temporal < 1.0 and 0.0 <= self.layer_carry < 1.0 and self.rank >= 1):
            raise ValueError(f"bad routing dynamics {self}: temporal and layer_carry in [0, 1), rank >= 1")


@dataclass(frozen=True)
class RoutingPreset:
    """``dynamics`` None: i.i.d. logits. ``bands``: figure (``bench.routing_stats``'s overall figures) -> the
    accepted [low, high], at ``BAND_EXPERTS`` experts top-``BAND_TOP_K``."""

    dynamics: Dynamics | None
    bands: Mapping[str, tuple[float, float]] = field(default_factory=dict)


ROUTING_PRESETS: dict[str, RoutingPreset] = {
    # Measured on the twin of the scaled checkpoint (seed 0, 2000 steps): recall 0.06, LRU-64 0.38 from popularity alone
    "random": RoutingPreset(None, {"next_gate_recall_8": (0.0, 0.15), "lru_hit_64": (0.30, 0.46),
                                   "top32_share_error": (0.0, 0.04)}),
    # temporal 0.73 gives LRU-64 ~0.65 (and LRU-128 ~0.80, the published 81 %); layer_carry 0.975 recall ~0.8
    "trained": RoutingPreset(Dynamics(temporal=0.73, layer_carry=0.975, rank=64),
                             {"next_gate_recall_8": (0.75, 0.85), "lru_hit_64": (0.60, 0.70),
                              "top32_share_error": (0.0, 0.04)}),
}
