"""Every place where glm53 reaches into exllamav3's internals, written against exllamav3 1.6.5.

Patch points (each checked by ``check_internals`` when a model is loaded; a mismatch fails loudly):

- ``exllamav3.modules.BlockSparseMLP`` instances: ``routing_fn`` (instance attribute, the per-layer top-k
  router; wrapped to count expert picks on the device), ``routing_cfg.e_score_correction_bias`` and its lazily
  built copies ``e_score_bias_h`` / ``e_score_bias_f32`` (rewritten in place to set router biases),
  ``num_experts``, ``key``.
- ``exllamav3.model.Model.modules`` (walked to find the MoE layers).
"""

from __future__ import annotations

import re

import torch

EXLLAMAV3_VERSION = "1.6.5"


class InternalsChanged(RuntimeError):
    """The installed exllamav3 is not the one these patches were written against."""


def check_internals(model) -> None:
    """:raise InternalsChanged: wrong exllamav3 version, or an MoE layer without the attributes we use."""
    from exllamav3.version import __version__

    if __version__ != EXLLAMAV3_VERSION:
        raise InternalsChanged(f"glm53 patches exllamav3 {EXLLAMAV3_VERSION} internals; exllamav3 {__version__} is installed")
    for _, mlp in moe_layers(model):
        for name in ("routing_fn", "routing_cfg", "num_experts", "key"):
            if not hasattr(mlp, name):
                raise InternalsChanged(f"exllamav3 BlockSparseMLP {mlp.key!r} has no {name!r}; the patch points moved")
        if not hasattr(mlp.routing_cfg, "e_score_correction_bias"):
            raise InternalsChanged("exllamav3 RoutingCFG has no e_score_correction_bias; the patch points moved")


def _walk(module):
    yield module
    for child in getattr(module, "modules", []):
        yield from _walk(child)


def moe_layers(model) -> list[tuple[int, object]]:
    """(decoder layer index, BlockSparseMLP) for every routed MoE layer, in layer order."""
    from exllamav3.modules import BlockSparseMLP

    found = []
    for top in model.modules:
        for m in _walk(top):
            if isinstance(m, BlockSparseMLP) and getattr(m, "routing_gate", None) is not None:
                match = re.search(r"layers\.(\d+)\.mlp$", m.key)
                if match:
                    found.append((int(match.group(1)), m))
    return sorted(found, key=lambda x: x[0])


class RoutingCounter:
    """Counts, per MoE layer and expert, how often the router picked it, on the device (no host sync per layer).

    Installed by wrapping each layer's ``routing_fn``; ``uninstall`` restores the originals. With ``max_rows``,
    only routing calls of at most that many rows count (decode steps, not prefill chunks).
    """

    def __init__(self, model, max_rows: int | None = None):
        self.max_rows = max_rows
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("the model has no routed MoE layers")
        num_experts = self.layers[0][1].num_experts
        device = self.layers[0][1].routing_cfg.gate_tensor.device
        self.counts = torch.zeros((len(self.layers), num_experts), dtype=torch.int64, device=device)  # [L, E]
        self._originals = {}

    def install(self) -> None:
        for row, (_, mlp) in enumerate(self.layers):
            original = mlp.routing_fn
            self._originals[row] = original

            def counted(bsz, cfg, z, params, _orig=original, _row=row):
                selected, weights = _orig(bsz, cfg, z, params)
                counted_call = self.max_rows is None or bsz <= self.max_rows
                if counted_call and not params.get("tp_warmup") and not params.get("autosplit_measure"):
                    flat = selected.reshape(-1)  # [bsz * top_k]
                    self.counts[_row].index_add_(0, flat, torch.ones_like(flat))
                return selected, weights

            mlp.routing_fn = counted

    def uninstall(self) -> None:
        for row, (_, mlp) in enumerate(self.layers):
            if row in self._originals:
                mlp.routing_fn = self._originals.pop(row)

    def reset(self) -> None:
        self.counts.zero_()

    def snapshot(self) -> dict[int, list[int]]:
        """{decoder layer index: picks per expert} (synchronises with the device)."""
        host = self.counts.cpu().tolist()
        return {layer: host[row] for row, (layer, _) in enumerate(self.layers)}


def set_router_bias(mlp, bias: torch.Tensor) -> None:
    """Replace a layer's ``e_score_correction_bias`` in place, and the copies the routing kernels read."""
    with torch.inference_mode():  # the loaded tensors are inference tensors
        _set_router_bias(mlp.routing_cfg, mlp.key, bias)


def _set_router_bias(cfg, key: str, bias: torch.Tensor) -> None:
    esb = cfg.e_score_correction_bias
    if esb is None or esb.shape != bias.shape:
        raise ValueError(f"{key}: router bias of shape {tuple(bias.shape)} does not fit {None if esb is None else tuple(esb.shape)}")
    esb.copy_(bias.to(esb.dtype))
    # the kernels read derived copies built once from the bias (addresses may be baked into graphs: update in place)
    half = getattr(cfg, "e_score_bias_h", None)
    if half is not None and half.data_ptr() != esb.data_ptr():
        half.copy_((esb.float() - esb.float().mean()).half())
    f32 = getattr(cfg, "e_score_bias_f32", None)
    if f32 is not None:
        f32.copy_(esb.float())
