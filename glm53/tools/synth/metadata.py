"""config.json, generation_config.json and processor_config.json of a synthetic checkpoint.

Keys follow what exllamav3 1.6.5's ``Glm5NextConfig`` reads (``architecture/glm5_next.py``): it requires
``text_config`` with the attention, schedule, KDA, DSA-indexer, mHC and MoE keys below, a ``vision_config``
that ``read_glm4v_vision_config`` accepts and a ``processor_config.json`` that ``read_glm4v_pp_config``
accepts, even for text-only use (the vision tower is never loaded here and has no tensors).
"""

from __future__ import annotations

from typing import Any

from glm53.models.glm_special_tokens import END_OF_TEXT, SPECIAL_TOKENS

from .presets import N_DENSE, ModelShape

ARCHITECTURE = "Glm5NextForConditionalGeneration"
EXLLAMAV3_VERSION = "1.6.5"
RMS_NORM_EPS = 1e-5
MAX_POSITION_EMBEDDINGS = 202752  # an assumption: GLM-5's published context; nothing here depends on it

_IDS = {t.text: t.glm_id for t in SPECIAL_TOKENS}
EOS_IDS = [t.glm_id for t in SPECIAL_TOKENS if t.ends_completion]  # <|endoftext|>, <|user|>, <|observation|>
PAD_ID = _IDS[END_OF_TEXT]


def layer_types(shape: ModelShape) -> list[str]:
    return ["deepseek_sparse_attention" if shape.is_mla(i) else "linear_attention" for i in range(shape.layers)]


def mlp_layer_types(shape: ModelShape) -> list[str]:
    return ["dense" if i < N_DENSE else "sparse" for i in range(shape.layers)]


def text_config(shape: ModelShape) -> dict[str, Any]:
    s = shape
    return {
        "model_type": "glm5_next_text",
        "hidden_size": s.hidden,
        "vocab_size": s.vocab,
        "num_hidden_layers": s.layers,
        "layer_types": layer_types(s),
        "mlp_layer_types": mlp_layer_types(s),
        "first_k_dense_replace": N_DENSE,
        # MLA (NoPE) with the DSA indexer
        "num_attention_heads": s.mla_heads,
        "q_lora_rank": s.q_lora_rank,
        "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim,
        "qk_rope_head_dim": 0,
        "v_head_dim": s.v_head_dim,
        "index_n_heads": s.index_heads,
        "index_head_dim": s.index_head_dim,
        "index_topk": s.index_topk,
        "index_kpool": s.index_kpool,
        "index_kpool_always_select_tail": True,
        "index_kpool_compress": True,
        # Which real layers share an indexer is not published; "full" everywhere is the heavier choice.
        "indexer_types": ["full"] * s.layers,
        # KDA linear attention
        "linear_attn_config": {
            "num_heads": s.kda_heads,
            "head_dim": s.kda_head_dim,
            "short_conv_kernel_size": s.kda_conv,
            "gate_lower_bound": -5.0,
        },
        # mHC hyper-connections
        "mhc": True,
        "hc_mult": s.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        # MLP and MoE
        "hidden_act": "silu",
        "intermediate_size": s.dense_intermediate,
        "moe_intermediate_size": s.moe_intermediate,
        "n_routed_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "n_shared_experts": s.shared_experts,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 10.0,
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "rms_norm_eps": RMS_NORM_EPS,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def vision_config(shape: ModelShape) -> dict[str, Any]:
    """A GLM-4.5V-sized tower description: it must parse, and nothing loads it."""
    return {
        "model_type": "glm5_next_vision",
        "depth": 24,
        "hidden_act": "silu",
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_heads": 12,
        "out_hidden_size": shape.hidden,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "attention_bias": False,
        "image_size": 336,
        "rms_norm_eps": RMS_NORM_EPS,
    }


def quantization_config(shape: ModelShape, bits: float) -> dict[str, Any]:
    """The block exllamav3's converter writes; exllamav3 ignores it, TabbyAPI and transformers read it."""
    return {
        "quant_method": "exl3",
        "version": EXLLAMAV3_VERSION,
        "bits": round(bits, 3),
        "head_bits": shape.head_bits,
        "calibration": {"rows": 250, "cols": 2048},
        "out_scales": "auto",
        "codebook": "mul1",
    }


def config_json(shape: ModelShape, bits: float, synth: dict[str, Any]) -> dict[str, Any]:
    """The whole config.json; ``synth`` is the ``glm53_synth`` block that marks the checkpoint as synthetic."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "glm5_next",
        "image_start_token_id": _IDS["<|begin_of_image|>"],
        "image_end_token_id": _IDS["<|end_of_image|>"],
        "eos_token_id": EOS_IDS,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
        "text_config": text_config(shape),
        "vision_config": vision_config(shape),
        "quantization_config": quantization_config(shape, bits),
        "glm53_synth": synth,
    }


def generation_config() -> dict[str, Any]:
    return {"eos_token_id": EOS_IDS, "pad_token_id": PAD_ID}


def processor_config() -> dict[str, Any]:
    image = {
        "image_processor_type": "Glm5NextImageProcessor",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],  # CLIP's, as GLM-4.xV uses
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_image_tokens": 4,
        "max_image_tokens": 16384,
    }
    return {"image_processor": image}
