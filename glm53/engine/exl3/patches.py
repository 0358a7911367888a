"""Every place where glm53 reaches into exllamav3's model internals, written against exllamav3 1.6.5
(``EXLLAMAV3_VERSION``): ``check_version`` refuses any other version before a model loads, and ``check_internals``
/ ``check_offload_internals`` check the attributes below once it has loaded; a mismatch fails loudly.

Patch points:

- ``exllamav3.modules.BlockSparseMLP`` instances: ``routing_fn`` (instance attribute, the per-layer top-k
  router; wrapped to count expert picks on the device), ``routing_cfg.e_score_correction_bias`` and its lazily
  built copies ``e_score_bias_h`` / ``e_score_bias_f32`` (rewritten in place to set router biases),
  ``num_experts``, ``key``.
- ``exllamav3.model.Model.modules`` (walked to find the MoE layers) and ``Model.fwd_modules`` (the first
  module's ``forward`` is wrapped to see each forward's size before any layer runs).
- ``Config.stc.get_tensor`` (``SafetensorsCollection``, wrapped while the model loads): routed expert trellises
  are answered with CUDA aliases of the host store instead of being read into VRAM. ``LinearEXL3`` keeps the
  tensor it is given as ``trellis`` and builds its pointers from it.
- ``exllamav3_ext.pinned_cuda_view`` (a CUDA alias of pinned host memory).
- ``exllamav3_ext.BC_BlockSparseMLP`` (wrapped while the model loads): its 44th positional argument is the
  ``(E, 2)`` gate/up trellis pointer table of the fused decode kernels, a local of ``load_local`` that Python
  keeps no other reference to; it is captured by matching its first column against the gate table.
- ``BlockSparseMLP.multi_gate / multi_up / multi_down .ptrs_trellis``: the ``(E,)`` int64 device tables that
  the fused prefill kernel, the batched-reconstruct tier (which keeps references to the same tensors) and, with
  the captured gate/up table, the fused decode kernels read at launch. Rewriting entries in place redirects
  them. The per-expert graph/dq paths use each expert's own ``trellis`` (the host alias: correct bytes).
- ``BlockSparseMLP.forward`` (instance attribute, wrapped for prefill staging, and by the measurement tools'
  perturbations and taps: ``wrap_output``); the first forward module's input (token ids or embeddings, ``forward_rows``).
- ``BlockSparseMLP.cpu_split_combine`` (instance attribute, wrapped): called by ``forward`` on the fp32 routed sum
  before its cast, where exllamav3 adds its own CPU split's partial; fast mode adds the CPU tier's there. The
  fused decode kernels skip a pick whose router weight is 0 (``exl3_moe_coop_kernel.cuh``: ``slot_info``), which
  is how the CPU tier's picks are kept from the GPU.
- ``BlockSparseMLP.routing_cfg.gate_tensor`` (hidden x experts) and ``e_score_correction_bias``: prefetch's
  predictor scores the next layer's router on this layer's router input (``routers``).
- ``exllamav3_ext.exl3_moe`` with a layer's ``multi_gate / multi_up / multi_down`` tables, ``fused_mode_buffers``,
  ``activation_fn_idx`` and ``act_limit``, called as ``BlockSparseMLP.forward``'s fused tier calls it (no output
  scratch: contributions are added atomically into the fp32 output): fast mode's GPU fallback computes the
  experts of a CPU job that did not arrive in time into the routed sum (``fused_experts``).

The generator's patch points (the prompt's single-pass prefill and the recurrent checkpoint at its end) are in
``prefill``, under the same version check.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

EXLLAMAV3_VERSION = "1.6.5"


class InternalsChanged(RuntimeError):
    """The installed exllamav3 is not the one these patches were written against."""


def installed_version() -> str:
    """The installed exllamav3's version (imports exllamav3, which loads its extension)."""
    from exllamav3.version import __version__

    return __version__


def check_version() -> None:
    """:raise InternalsChanged: the installed exllamav3 is not the version every patch point was written against."""
    installed = installed_version()
    if installed != EXLLAMAV3_VERSION:
        raise InternalsChanged(f"glm53 patches exllamav3 {EXLLAMAV3_VERSION} internals; exllamav3 {installed} is installed")


def check_internals(model) -> None:
    """:raise InternalsChanged: wrong exllamav3 version, or an MoE layer without the attributes we use."""
    check_version()
    for _, mlp in moe_layers(model):
        for name in ("routing_fn", "routing_cfg", "num_experts", "key"):
            if not hasattr(mlp, name):
                raise InternalsChanged(f"exllamav3 BlockSparseMLP {mlp.key!r} has no {name!r}; the patch points moved")
        if not hasattr(mlp.routing_cfg, "e_score_correction_bias"):
            raise InternalsChanged("exllamav3 RoutingCFG has no e_score_correction_bias; the patch points moved")


def check_offload_internals(model) -> None:
    """What the offload layer needs beyond ``check_internals``. :raise InternalsChanged:"""
    from exllamav3.ext import exllamav3_ext as ext

    check_internals(model)
    for name in ("pinned_cuda_view", "BC_BlockSparseMLP"):
        if not hasattr(ext, name):
            raise InternalsChanged(f"exllamav3_ext has no {name}; the patch points moved")
    if not hasattr(model, "fwd_modules") or not hasattr(model.config, "stc"):
        raise InternalsChanged("exllamav3 Model has no fwd_modules or Config no stc; the patch points moved")
    for _, mlp in moe_layers(model):
        for name in ("cpu_split_combine", "act_limit", "num_experts_per_tok"):
            if not hasattr(mlp, name):
                raise InternalsChanged(f"exllamav3 BlockSparseMLP {mlp.key!r} has no {name!r}; the patch points moved")


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
        self._removers = {}

    def install(self) -> None:
        for row, (_, mlp) in enumerate(self.layers):
            self._removers[row] = add_routing_hook(mlp, lambda selected, params, _row=row: self._count(_row, selected))

    def _count(self, row: int, selected: torch.Tensor) -> None:
        if self.max_rows is None or selected.shape[0] <= self.max_rows:
            flat = selected.reshape(-1)  # [bsz * top_k]
            self.counts[row].index_add_(0, flat, torch.ones_like(flat))

    def uninstall(self) -> None:
        for remove in self._removers.values():
            remove()
        self._removers.clear()

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


# ---- the offload layer's patch points

GU_TABLE_ARG = 43  # position of the (E, 2) gate/up trellis table in BC_BlockSparseMLP's constructor (1.6.5)
GATE_TABLE_ARG = 16  # the gate (E,) trellis table, whose values the gate/up table's first column repeats


@contextmanager
def expert_trellises_from(config, lookup):
    """While the model loads, answer routed expert trellis requests with ``lookup(key)`` (a tensor, or None to
    read as usual) instead of reading them into VRAM."""
    stc = config.stc
    original = stc.get_tensor

    def get_tensor(key, *args, **kwargs):
        if key.endswith(".trellis"):
            found = lookup(key)
            if found is not None:
                return found
        return original(key, *args, **kwargs)

    stc.get_tensor = get_tensor
    try:
        yield
    finally:
        del stc.get_tensor  # back to the class's method


@contextmanager
def capture_gate_up_tables(captured: dict[int, torch.Tensor]):
    """While the model loads, record each MoE layer's gate/up pointer table, keyed by the address of its gate
    table (``mlp.multi_gate.ptrs_trellis.data_ptr()``)."""
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules import block_sparse_mlp

    original = ext.BC_BlockSparseMLP

    def construct(*args, **kwargs):
        if len(args) > GU_TABLE_ARG:
            gate, gu = args[GATE_TABLE_ARG], args[GU_TABLE_ARG]
            if not (isinstance(gu, torch.Tensor) and gu.dim() == 2 and gu.shape[1] == 2 and gu.dtype == torch.int64
                    and isinstance(gate, torch.Tensor) and gu.shape[0] == gate.shape[0] and torch.equal(gu[:, 0], gate)):
                raise InternalsChanged("BC_BlockSparseMLP's arguments moved: no (E, 2) gate/up table at position "
                                       f"{GU_TABLE_ARG} matching the gate table at {GATE_TABLE_ARG}")
            captured[gate.data_ptr()] = gu
        return original(*args, **kwargs)

    block_sparse_mlp.ext.BC_BlockSparseMLP = construct
    try:
        yield
    finally:
        block_sparse_mlp.ext.BC_BlockSparseMLP = original


def expert_tables(mlp, captured: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's gate, up, down (E,) and gate/up (E, 2) trellis pointer tables.

    :raise InternalsChanged: the layer has no fused tables (not quantised, or exllamav3 changed).
    """
    mg, mu, md = (getattr(mlp, n, None) for n in ("multi_gate", "multi_up", "multi_down"))
    if mg is None or mu is None or md is None or getattr(mlp, "bc", None) is None:
        raise InternalsChanged(f"{mlp.key}: no fused EXL3 expert tables (multi_gate/up/down, bc); the expert offload needs them")
    gu = captured.get(mg.ptrs_trellis.data_ptr())
    if gu is None:
        raise InternalsChanged(f"{mlp.key}: its gate/up table was not captured while loading")
    return mg.ptrs_trellis, mu.ptrs_trellis, md.ptrs_trellis, gu


def add_routing_hook(mlp, hook, with_inputs: bool = False):
    """Call ``hook(selected, params)`` after the layer's router picked experts (same stream, no sync); with
    ``with_inputs``, ``hook(selected, weights, z, params)`` with the router weights (which the hook may change in
    place before the experts run) and the router's input. Returns a function that removes it."""
    original = mlp.routing_fn

    def routed(bsz, cfg, z, params):
        selected, weights = original(bsz, cfg, z, params)
        if not params.get("tp_warmup") and not params.get("autosplit_measure"):
            if with_inputs:
                hook(selected, weights, z, params)
            else:
                hook(selected, params)
        return selected, weights

    mlp.routing_fn = routed

    def remove():
        mlp.routing_fn = original

    return remove


def wrap_forward(module, before=None, after=None):
    """Call ``before(x, params)`` / ``after(x, params)`` around the module's forward. Returns a remover (which
    puts back the forward it found, an earlier wrapper included)."""
    original = module.forward

    def forward(x, params, *args, **kwargs):
        if before is not None:
            before(x, params)
        try:
            return original(x, params, *args, **kwargs)
        finally:
            if after is not None:
                after(x, params)

    return _replace_forward(module, forward)


def wrap_output(module, transform):
    """Return ``transform(y)`` for the module's output ``y`` (the measurement tools' perturbations and taps).
    Returns a remover (as :func:`wrap_forward`'s)."""
    original = module.forward

    def forward(x, params, *args, **kwargs):
        return transform(original(x, params, *args, **kwargs))

    return _replace_forward(module, forward)


def _replace_forward(module, forward):
    """Make ``forward`` the module's (an instance attribute); the remover puts back the one found."""
    earlier = vars(module).get("forward")
    module.forward = forward

    def remove():
        if earlier is None:
            del module.forward
        else:
            module.forward = earlier

    return remove


def experts_see_the_router_input(mlp) -> bool:
    """Whether the routed experts' input is the router's input (no routed/router pre-norm, no latent projection):
    then the routing hook's ``z`` is what the CPU tier must compute the experts on."""
    return all(getattr(mlp, name, None) is None for name in ("router_pre_norm", "routed_pre_norm", "latent_in")) \
        and not getattr(mlp, "alt_residual_channel", False)


def wrap_routed_sum(mlp, combine):
    """Call ``combine(final_hidden_states)`` on the layer's routed sum (fp32, before the shared experts' merge of
    the non-fused paths, the post norms and the cast to the output dtype), where exllamav3 folds in its own CPU
    split's partial (``cpu_split_combine``). Returns a remover."""
    original = mlp.cpu_split_combine

    def fold(final_hidden_states, cpu_partial, cpu_pending, shape):
        return combine(original(final_hidden_states, cpu_partial, cpu_pending, shape))

    mlp.cpu_split_combine = fold

    def remove():
        del mlp.cpu_split_combine

    return remove


def fused_experts(mlp):
    """``run(y, acc, count, token_sorted, weight_sorted)``: the layer's experts for sorted picks, computed by
    exllamav3's fused expert kernel and added (times each pick's weight) into ``acc`` (fp32 ``[T, hidden]``, the
    routed sum) for the inputs ``y`` (fp16 ``[T, hidden]``); ``count`` (int64 ``[E + 1]``) holds each expert's pick
    count, the last bin picks to skip. Everything stays on the device: with every pick in the last bin the kernel
    computes nothing. Expert weights are read where the layer's pointer tables say (a VRAM slot or the host store).

    :raise InternalsChanged: the layer has no fused tier (exllamav3 changed, or the layer is not quantised).
    """
    from exllamav3.ext import exllamav3_ext as ext

    buffers = getattr(mlp, "fused_mode_buffers", None)
    if buffers is None or not all(hasattr(mlp, n) for n in ("multi_up", "multi_down", "activation_fn_idx", "gated", "fused_rows")):
        raise InternalsChanged(f"{mlp.key}: no fused expert tier (fused_mode_buffers, multi_up/down, activation_fn_idx); "
                               "fast mode's GPU fallback needs it")
    gate = mlp.multi_gate if mlp.gated else mlp.multi_up  # a gateless layer passes up as the gate (exllamav3 does)
    up, down = mlp.multi_up, mlp.multi_down
    act_limit, rows = float(mlp.act_limit or 0.0), int(mlp.fused_rows)

    def run(y, acc, count, token_sorted, weight_sorted):
        ext.exl3_moe(y, acc, count, token_sorted, weight_sorted, buffers.temp_state_g, buffers.temp_state_u,
                     buffers.temp_intermediate_g, buffers.temp_intermediate_u, mlp.activation_fn_idx, gate.K, up.K, down.K,
                     gate.ptrs_trellis, gate.ptrs_suh, gate.ptrs_svh, up.ptrs_trellis, up.ptrs_suh, up.ptrs_svh,
                     down.ptrs_trellis, down.ptrs_suh, down.ptrs_svh, gate.mcg, gate.mul1, up.mcg, up.mul1, down.mcg,
                     down.mul1, act_limit, -1, None, None, 1, rows, 16)

    return run


def first_forward_module(model):
    return model.fwd_modules[0][0]


def pinned_cuda_view(tensor: torch.Tensor, device_index: int) -> torch.Tensor:
    from exllamav3.ext import exllamav3_ext as ext

    return ext.pinned_cuda_view(tensor, device_index)


def forward_rows(x: torch.Tensor) -> int:
    """Tokens in a forward, from the first module's input: token ids ``[bsz, seq]``, or embeddings ``[bsz, seq,
    hidden]`` / ``[rows, hidden]``."""
    return x.numel() if x.dtype in (torch.int32, torch.int64) else x.shape[0] * (x.shape[1] if x.dim() > 2 else 1)


# ---- the offload attached to a model (glm53.engine.exl3.offload runs these in order)


@dataclass(frozen=True)
class MoeLayers:
    """A model's routed MoE layers in the host store's order, and what the offload reads off them."""

    mlps: list  # BlockSparseMLP
    tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer: gate, up, down (E,), gate/up (E, 2)
    top_k: int  # experts picked per token
    act_limit: float  # GLM's swiglu_limit (0: no clamp)


def load_offloaded(model, store, load: Callable[[], None]) -> MoeLayers:
    """Run ``load()`` (the model's ``Model.load``) with every routed expert's trellis answered from ``store`` (a
    pinned ``HostStore``) and the gate/up pointer tables captured; then check the offload's patch points and match
    the model's MoE layers with the store's.

    :raise InternalsChanged: a patch point moved. :raise RuntimeError: the model's MoE layers or expert counts are not
        the store's.
    """
    captured: dict[int, torch.Tensor] = {}
    with expert_trellises_from(model.config, store.trellis_view), capture_gate_up_tables(captured):
        load()
    check_offload_internals(model)
    by_key = {mlp.key: mlp for _, mlp in moe_layers(model)}
    if sorted(by_key) != sorted(store.layer_keys):
        raise RuntimeError(f"the model's MoE layers {sorted(by_key)} are not the host store's {store.layer_keys}")
    mlps = [by_key[k] for k in store.layer_keys]
    for mlp in mlps:
        if mlp.num_experts != store.num_experts:
            raise RuntimeError(f"{mlp.key}: {mlp.num_experts} experts, the host store has {store.num_experts}")
    tables = [expert_tables(mlp, captured) for mlp in mlps]
    return MoeLayers(mlps, tables, int(mlps[0].num_experts_per_tok), float(mlps[0].act_limit or 0.0))


def check_cpu_tier_fits(layers: MoeLayers) -> None:
    """:raise RuntimeError: a layer's experts do not see the router's input, which the CPU tier computes them on."""
    for mlp in layers.mlps:
        if not experts_see_the_router_input(mlp):
            raise RuntimeError(f"{mlp.key}: the experts' input is not the router's (a pre-norm or latent projection); "
                               "the CPU tier does not support this model")


def routers(layers: MoeLayers) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per MoE layer its router as prefetch's predictor scores it: ``routing_cfg.gate_tensor`` (hidden x experts,
    what exllamav3's routing functions multiply the router input by) and ``routing_cfg.e_score_correction_bias``.
    :raise InternalsChanged: a layer without them."""
    out = []
    for mlp in layers.mlps:
        gate = getattr(mlp.routing_cfg, "gate_tensor", None)
        if not isinstance(gate, torch.Tensor) or gate.dim() != 2 or gate.shape[1] != mlp.num_experts:
            raise InternalsChanged(f"exllamav3 BlockSparseMLP {mlp.key!r}: routing_cfg.gate_tensor is not a hidden x "
                                   f"{mlp.num_experts} tensor; the patch points moved")
        out.append((gate, mlp.routing_cfg.e_score_correction_bias))
    return out


def hook_offload(model, layers: MoeLayers, offload) -> list[Callable[[], None]]:
    """Install the running offload (``glm53.offload.runtime.Offload``) on the model: after each layer's routing
    (``offload.routed``), around each MoE layer (``before_layer``/``after_layer``), on its fp32 routed sum where a
    part adds to it (``routed_sum``: the CPU tier) and before the first module's forward (``forward_start``). The
    hooks look the offload's methods up at each call. Returns the removers, last installed last."""
    removers = []
    sums = bool(offload.hooks("routed_sum"))
    for row, mlp in enumerate(layers.mlps):
        removers.append(add_routing_hook(
            mlp, lambda sel, w, z, params, _row=row: offload.routed(_row, sel, w, z), with_inputs=True))
        if sums:
            removers.append(wrap_routed_sum(mlp, lambda fhs, _row=row: offload.routed_sum(_row, fhs)))
        removers.append(wrap_forward(mlp, before=lambda x, p, _row=row: offload.before_layer(_row),
                                     after=lambda x, p, _row=row: offload.after_layer(_row)))
    removers.append(wrap_forward(first_forward_module(model), before=lambda x, p: offload.forward_start(forward_rows(x))))
    return removers
