"""Facts about a checkpoint: its ``config.json`` (read here and nowhere else) and what its safetensors headers say
(no tensor data is read)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .safetensors_header import read_header

# Routed experts: model.layers.N.mlp.experts.E.*; the shared expert is mlp.shared_experts and does not match.
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
MOE_LAYER = re.compile(r"^(.*)\.mlp\.experts\.\d+\.")
# The per-channel sign/scale vectors of each EXL3 linear, of which the CPU tier keeps its own fp16 copies.
SIGN_SCALE = re.compile(r"\.(suh|svh)$")
# A checkpoint's own routing profile, {"model.language_model.layers.N.mlp": [picks per expert]}: the synthetic
# writer ships the routing its router biases were fitted to; the expert cache warm-starts from it.
ROUTING_PROFILE_FILE = "glm53-routing-profile.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class ExpertBytes:
    routed: int  # bytes of every routed-expert tensor: what the host store holds once
    sign_scale: int  # of those, the suh/svh vectors
    moe_layers: int = 1  # layers with routed experts

    @property
    def layer_bytes(self) -> int:
        """One MoE layer's routed experts (what a prefill's forward reads together)."""
        return self.routed // max(self.moe_layers, 1)


def has_config(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a checkpoint's ``config.json`` (what makes a directory a checkpoint)."""
    return (Path(model_dir) / CONFIG_FILE).is_file()


def read_config(model_dir: Path, name: str = CONFIG_FILE) -> dict:
    """The checkpoint's ``config.json`` (or, by ``name``, another of its JSON files such as ``generation_config.json``).

    :raise OSError: the file is missing or unreadable. :raise ValueError: it is not a JSON object.
    """
    data = json.loads((Path(model_dir) / name).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{Path(model_dir) / name} holds a JSON {type(data).__name__}, not an object")
    return data


def config_bytes(model_dir: Path) -> bytes:
    """The bytes of ``config.json`` as they are on disk (for a digest of the checkpoint), or b"" without one."""
    path = Path(model_dir) / CONFIG_FILE
    return path.read_bytes() if path.is_file() else b""


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
    layers = set()
    for shard in shards(model_dir):
        header, _ = read_header(shard)
        for name, entry in header.items():
            if ROUTED_EXPERT.search(name):
                layers.add(MOE_LAYER.match(name).group(1))
                size = entry["data_offsets"][1] - entry["data_offsets"][0]
                routed += size
                if SIGN_SCALE.search(name):
                    sign_scale += size
    return ExpertBytes(routed, sign_scale, max(len(layers), 1))
