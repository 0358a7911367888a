"""Facts about a checkpoint read from its safetensors headers alone (no tensor data is read)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .safetensors_header import read_header

# Routed experts: model.layers.N.mlp.experts.E.*; the shared expert is mlp.shared_experts and does not match.
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
# The per-channel sign/scale vectors of each EXL3 linear, of which the CPU tier keeps its own fp16 copies.
SIGN_SCALE = re.compile(r"\.(suh|svh)$")
# A checkpoint's own routing profile, {"model.language_model.layers.N.mlp": [picks per expert]}: the synthetic
# writer ships the routing its router biases were fitted to; the expert cache warm-starts from it.
ROUTING_PROFILE_FILE = "glm53-routing-profile.json"


@dataclass(frozen=True)
class ExpertBytes:
    routed: int  # bytes of every routed-expert tensor: what the host store holds once
    sign_scale: int  # of those, the suh/svh vectors


def shards(model_dir: Path) -> list[Path]:
    """The checkpoint's shards: those its index names, else every .safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def expert_bytes(model_dir: Path) -> ExpertBytes:
    """:raise OSError, ValueError, KeyError: a missing or unreadable shard or index."""
    routed = sign_scale = 0
    for shard in shards(model_dir):
        header, _ = read_header(shard)
        for name, entry in header.items():
            if ROUTED_EXPERT.search(name):
                size = entry["data_offsets"][1] - entry["data_offsets"][0]
                routed += size
                if SIGN_SCALE.search(name):
                    sign_scale += size
    return ExpertBytes(routed, sign_scale)
