"""The routing profile the expert cache starts from, and the one it learns while serving.

A profile is ``{"<MoE layer key>": [picks per expert]}``. At start the cache takes the checkpoint's own
(``glm53-routing-profile.json`` beside its shards, as the synthetic writer ships one), else one learned by an earlier
run of the same checkpoint (under ``GLM53_ROOT``/profiles/, named by a digest of its ``config.json`` and path), else
none (a cold start). At shutdown this run's decode picks are added to the learned one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from ..models.checkpoint import ROUTING_PROFILE_FILE, config_bytes

log = logging.getLogger(__name__)


def warm_start(model_dir: Path, root: Path | None, layer_keys: list[str]) -> tuple[np.ndarray | None, str]:
    """(float64 [layers, experts] picks per expert in ``layer_keys`` order, or None; where it came from)."""
    for source, path in (("checkpoint", Path(model_dir) / ROUTING_PROFILE_FILE), ("learned", learned_path(model_dir, root))):
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                return np.array([data[k] for k in layer_keys], dtype=np.float64), f"{source} ({path})"
            except (KeyError, ValueError, TypeError) as e:
                log.warning("ignoring routing profile %s: %s", path, e)
    return None, "none (cold start)"


def learned_path(model_dir: Path, root: Path | None) -> Path | None:
    """Where the profile learned for this checkpoint lives (None without a ``GLM53_ROOT``)."""
    if root is None:
        return None
    model_dir = Path(model_dir)
    digest = hashlib.sha256(config_bytes(model_dir) + str(model_dir.resolve()).encode()).hexdigest()[:16]
    return Path(root) / "profiles" / f"{digest}.json"


def save_learned(path: Path, layer_keys: list[str], picks: np.ndarray) -> None:
    """Add this run's picks (int [layers, experts]) to the profile at ``path`` (written whole, then renamed)."""
    previous = json.loads(path.read_text()) if path.is_file() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(merge_profile(previous, layer_keys, picks)) + "\n")
    tmp.replace(path)


def merge_profile(previous: dict | None, layer_keys: list[str], picks: np.ndarray) -> dict[str, list[float]]:
    """A learned routing profile: this run's decode picks added to what earlier runs learned (a previous
    profile of other layers or sizes, from another checkpoint version, is replaced, not mixed in)."""
    out = {}
    for row, key in enumerate(layer_keys):
        counts = picks[row].astype(np.float64)
        old = (previous or {}).get(key)
        if isinstance(old, list) and len(old) == len(counts):
            counts = counts + np.asarray(old, dtype=np.float64)
        out[key] = counts.tolist()
    return out
