"""Every place where glm53 reaches into exllamav3's internals, written against exllamav3 1.6.5.

Patch points (each checked by ``check_internals`` when a model is loaded; a mismatch fails loudly):

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
- ``BlockSparseMLP.forward`` (instance attribute, wrapped for prefill staging).
- ``BlockSparseMLP.cpu_split_combine`` (instance attribute, wrapped): called by ``forward`` on the fp32 routed sum
  before its cast, where exllamav3 adds its own CPU split's partial; fast mode adds the CPU tier's there. The
  fused decode kernels skip a pick whose router weight is 0 (``exl3_moe_coop_kernel.cuh``: ``slot_info``), which
  is how the CPU tier's picks are kept from the GPU.
- ``exllamav3_ext.exl3_moe`` with a layer's ``multi_gate / multi_up / multi_down`` tables, ``fused_mode_buffers``,
  ``activation_fn_idx`` and ``act_limit``, called as ``BlockSparseMLP.forward``'s fused tier calls it (no output
  scratch: contributions are added atomically into the fp32 output): fast mode's GPU fallback computes the
  experts of a CPU job that did not arrive in time into the routed sum (``fused_experts``).
- ``exllamav3.generator.job.Job.prefill`` (recompiled from its source with one condition changed, see
  ``install_single_pass_prefill``): a generator flagged by ``set_single_pass_prefill`` does not split a recurrent
  model's prompt before its last page.
- ``exllamav3.modules.gated_delta_net.causal_conv1d_update`` and ``.gated_delta_rule_fn`` (module globals the
  recurrent layer's forward calls, wrapped) and ``Generator.recurrent_checkpoint`` (wrapped), with
  ``GDNState.position / slot / base_row / cache``, ``GDNLayerState.conv_state / recurrent_state``, the job's
  ``sequences[0].allocated_pages[i].phash / kv_position``, ``last_recurrent_checkpoint_pos`` and
  ``RecurrentCache.put`` (its ``len``, ``current_size``, ``max_size``, ``metrics`` for /stats), whose checkpoint layout
  (``PairedState.stash``: position, checkpoint_size, target -> {layer: (state row, conv window)}) they build: see
  ``install_prompt_end_checkpoints``.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from contextlib import contextmanager

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
    earlier = vars(module).get("forward")

    def forward(x, params, *args, **kwargs):
        if before is not None:
            before(x, params)
        try:
            return original(x, params, *args, **kwargs)
        finally:
            if after is not None:
                after(x, params)

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


# ---- the prompt's last page (exllamav3/generator/job.py, Job.prefill)

# For a recurrent model, stock prefill ends a forward at the prompt's last page boundary and runs the rest as a
# second forward, to stash a recurrent-state checkpoint there. Each forward of an offloaded model streams every
# non-resident expert over PCIe once, whatever its length, so the split doubles a prompt's time to first token.
LAST_PAGE_SPLIT = "            if self.generator.recurrent_cache is not None:\n                seqlen = len(seq.sequence_ids) - 1\n"
SINGLE_PASS_FLAG = "glm53_single_pass_prefill"
_SINGLE_PASS_CONDITION = f"if self.generator.recurrent_cache is not None and not getattr(self.generator, {SINGLE_PASS_FLAG!r}, False):"


def install_single_pass_prefill() -> None:
    """Replace ``Job.prefill`` by a copy whose last-page split is skipped for flagged generators (idempotent;
    unflagged generators run exactly the stock method). :raise InternalsChanged: the method's source changed."""
    from exllamav3.generator import job as job_module

    cls = job_module.Job
    if getattr(cls.prefill, SINGLE_PASS_FLAG, False):
        return
    source = inspect.getsource(cls.prefill)
    if source.count(LAST_PAGE_SPLIT) != 1:
        raise InternalsChanged("exllamav3 Job.prefill no longer splits off the prompt's last page where glm53 expects it; "
                               "the single-pass prefill patch point moved")
    condition, rest = LAST_PAGE_SPLIT.split("\n", 1)
    indent = condition[: len(condition) - len(condition.lstrip())]
    patched = textwrap.dedent(source.replace(LAST_PAGE_SPLIT, indent + _SINGLE_PASS_CONDITION + "\n" + rest))
    tree = ast.parse(patched)
    ast.increment_lineno(tree, cls.prefill.__code__.co_firstlineno - 1)  # tracebacks point into job.py's own lines
    namespace: dict = {}
    exec(compile(tree, inspect.getsourcefile(cls.prefill) or "<exllamav3 Job.prefill>", "exec"), vars(job_module), namespace)
    prefill = namespace["prefill"]
    prefill.__qualname__ = cls.prefill.__qualname__
    prefill.__doc__ = cls.prefill.__doc__
    setattr(prefill, SINGLE_PASS_FLAG, True)
    cls.prefill = prefill


def set_single_pass_prefill(generator, on: bool) -> None:
    """Prefill ``generator``'s jobs in one forward per chunk (``on``) or with stock's last-page split."""
    if on:
        install_single_pass_prefill()
    setattr(generator, SINGLE_PASS_FLAG, bool(on))


# ---- a recurrent-state checkpoint at the prompt's end, inside its one forward
# (exllamav3/modules/gated_delta_net.py, generator/job.py)

# With single-pass prefill a prompt's last forward runs past its last page boundary, where stock exllamav3 would
# have split the forward to stash the recurrent state; without a checkpoint there, an agent's next request (this
# prompt and more) prefills again from the previous one. Instead each recurrent layer splits its own work at that
# boundary: its short convolution and its scan run on the tokens before it (both carry their state through the
# sequence's slot, as between two forwards), the state is copied aside on the device, and both run on the rest.
# The MoE layers still stream their experts once. After the prefill step the copies become a checkpoint in
# exllamav3's recurrent cache under the hash of the page that ends at the boundary, as stock would stash it.
PROMPT_END_FLAG = "glm53_prompt_end_checkpoints"
CONV_PARAMS = ("mixed_qkv", "conv_state", "recurrent_slots", "conv1d_weight", "conv1d_bias", "history", "params", "token_major", "incremental")
SCAN_PARAMS = ("mixed_qkv", "beta", "g", "recurrent_state", "recurrent_slots", "history", "save_state", "num_k_heads", "num_v_heads",
               "k_dim", "v_dim", "k_head_dim", "v_head_dim", "params", "channelwise_g", "slots_in")


def split_point(position: int, length: int, page_size: int) -> int:
    """Tokens of a forward over ``[position, position + length)`` before the last page boundary inside it; 0 when
    it contains none (a forward that ends on a boundary needs no split: stock stashes there)."""
    boundary = (position + length) // page_size * page_size
    return boundary - position if position < boundary < position + length else 0


class PromptEndCheckpoints:
    """The device copies of each recurrent layer's state at a prefilling sequence's split point, until the prefill
    step's checkpoint sweep turns them into checkpoints (``commit``). Counters for /stats: made and dropped."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pending: dict[int, dict] = {}  # id(sequence state) -> {"state", "position", "conv": {layer: t}, "scan": {layer: t}}
        self.made = 0
        self.dropped = 0

    def note(self, state, position: int, part: str, layer, tensor: torch.Tensor) -> None:
        """Keep a copy of ``tensor``, one layer's ``part`` (conv window or state row) of ``state`` at ``position``."""
        entry = self.pending.get(id(state))
        if entry is None or entry["state"] is not state or entry["position"] != position:
            entry = self.pending[id(state)] = {"state": state, "position": position, "conv": {}, "scan": {}}
        entry[part][layer] = tensor.clone()

    def commit(self, jobs, recurrent_cache, layers: dict, host_copy) -> None:
        """Stash each job's capture as a checkpoint; drop what is left (a job that failed or was not checkpointable).

        :param layers: the cache's recurrent layers by key (a capture must hold every one of them).
        :param host_copy: copies a device tensor into exllamav3's pooled host buffers.
        """
        for job in jobs:
            state = getattr(job.recurrent_state, "target", None)
            entry = self.pending.pop(id(state), None) if state is not None else None
            if entry is not None and entry["state"] is state:
                if self._stash(job, entry, recurrent_cache, layers, host_copy):
                    self.made += 1
                else:
                    self.dropped += 1
        self.dropped += len(self.pending)
        self.pending.clear()

    def _stash(self, job, entry: dict, recurrent_cache, layers: dict, host_copy) -> bool:
        seq = job.sequences[0]
        pos = entry["position"]
        if not 0 < pos <= seq.kv_position or set(entry["conv"]) != set(layers) or set(entry["scan"]) != set(layers) \
                or getattr(job.recurrent_state, "draft", None) is not None:
            return False
        page = seq.allocated_pages[pos // self.page_size - 1]
        if page.kv_position != self.page_size:
            return False
        target = {key: (host_copy(entry["scan"][key]), host_copy(entry["conv"][key])) for key in layers}
        size = sum(t.numel() * t.element_size() for pair in target.values() for t in pair)
        recurrent_cache.put(page.phash, _Stashed({"position": pos, "checkpoint_size": size,
                                                  "target": {"position": pos, "checkpoint_size": size, **target}}))
        if pos > (job.last_recurrent_checkpoint_pos or 0):
            job.last_recurrent_checkpoint_pos = pos
        return True


def _sequence_state(params: dict | None, history: bool):
    """The one sequence's recurrent state of a plain (not speculative, not batched, not tensor-parallel) pass."""
    states = (params or {}).get("recurrent_states")
    if history or not states or len(states) != 1 or getattr(states[0], "exported", False):
        return None
    return states[0]


def _capture_of(state) -> PromptEndCheckpoints | None:
    return getattr(getattr(state, "cache", None), PROMPT_END_FLAG, None)


class _Stashed:
    """A ready checkpoint in the shape ``RecurrentCache.put`` takes a state in (``checkpoint_size``, ``stash()``)."""

    def __init__(self, stashed: dict):
        self._stashed = stashed
        self.checkpoint_size = stashed["checkpoint_size"]

    def stash(self) -> dict:
        return self._stashed


def _layer_key(state, attribute: str, tensor: torch.Tensor):
    return next((k for k, layer in state.cache.get_all_recurrent_layers().items() if getattr(layer, attribute, None) is tensor), None)


def _split_conv(original, page_size: int):
    def causal_conv1d_update(mixed_qkv, conv_state, recurrent_slots, conv1d_weight, conv1d_bias, history=False, params=None,
                             token_major=False, incremental=False):
        state = _sequence_state(params, history or incremental)
        capture = _capture_of(state)
        length = mixed_qkv.shape[1] if token_major else mixed_qkv.shape[2]
        cut = split_point(state.position, length, page_size) if capture is not None and conv_state is not None else 0
        key = _layer_key(state, "conv_state", conv_state) if cut else None
        if key is None:
            return original(mixed_qkv, conv_state, recurrent_slots, conv1d_weight, conv1d_bias, history, params, token_major, incremental)
        parts = (mixed_qkv[:, :cut], mixed_qkv[:, cut:]) if token_major else \
            (mixed_qkv[:, :, :cut].contiguous(), mixed_qkv[:, :, cut:].contiguous())
        first = original(parts[0], conv_state, recurrent_slots, conv1d_weight, conv1d_bias, history, params, token_major, incremental)
        capture.note(state, state.position + cut, "conv", key, conv_state[state.slot, :, : conv1d_weight.shape[-1]])
        rest = original(parts[1], conv_state, recurrent_slots, conv1d_weight, conv1d_bias, history, params, token_major, incremental)
        return torch.cat([first, rest], dim=1)  # (bsz, seqlen, dim) either way

    return causal_conv1d_update


def _split_scan(original, page_size: int):
    def gated_delta_rule_fn(mixed_qkv, beta, g, recurrent_state, recurrent_slots, history, save_state, num_k_heads, num_v_heads,
                            k_dim, v_dim, k_head_dim, v_head_dim, params=None, channelwise_g=False, slots_in=None):
        def run(q, b, gg):
            return original(q, b, gg, recurrent_state, recurrent_slots, history, save_state, num_k_heads, num_v_heads, k_dim, v_dim,
                            k_head_dim, v_head_dim, params, channelwise_g, slots_in)

        state = _sequence_state(params, history)
        capture = _capture_of(state)
        ok = capture is not None and save_state and recurrent_state is not None
        cut = split_point(state.position, mixed_qkv.shape[1], page_size) if ok else 0
        key = _layer_key(state, "recurrent_state", recurrent_state) if cut else None
        if key is None:
            return run(mixed_qkv, beta, g)
        first = run(mixed_qkv[:, :cut], beta[:, :cut], g[:, :cut])
        row = state.base_row()
        capture.note(state, state.position + cut, "scan", key, recurrent_state[row : row + 1])
        rest = run(mixed_qkv[:, cut:], beta[:, cut:], g[:, cut:])
        return torch.cat([first, rest.to(first.dtype)], dim=1)  # (bsz, seqlen, v_heads, v_head_dim)

    return gated_delta_rule_fn


def install_prompt_end_checkpoints() -> None:
    """Wrap the recurrent layers' convolution and scan, and the generator's checkpoint sweep after each prefill step
    (idempotent; caches without the flag run stock code). :raise InternalsChanged: a patch point moved."""
    from exllamav3.cache.recurrent import host_copy
    from exllamav3.constants import PAGE_SIZE
    from exllamav3.generator import generator as generator_module
    from exllamav3.modules import gated_delta_net

    if getattr(gated_delta_net.gated_delta_rule_fn, PROMPT_END_FLAG, False):
        return
    for name, expected in (("causal_conv1d_update", CONV_PARAMS), ("gated_delta_rule_fn", SCAN_PARAMS)):
        found = tuple(inspect.signature(getattr(gated_delta_net, name)).parameters)
        if found != expected:
            raise InternalsChanged(f"exllamav3 gated_delta_net.{name} takes {found}, glm53 expects {expected}; the patch point moved")
    stock_sweep = generator_module.Generator.recurrent_checkpoint
    if tuple(inspect.signature(stock_sweep).parameters) != ("self",):
        raise InternalsChanged("exllamav3 Generator.recurrent_checkpoint's signature moved; the patch point moved")

    def recurrent_checkpoint(self):
        stock_sweep(self)
        capture = getattr(self.cache, PROMPT_END_FLAG, None)
        if capture is not None and capture.pending:
            capture.commit(self.active_jobs, self.recurrent_cache, self.cache.get_all_recurrent_layers(), host_copy)

    conv = _split_conv(gated_delta_net.causal_conv1d_update, PAGE_SIZE)
    scan = _split_scan(gated_delta_net.gated_delta_rule_fn, PAGE_SIZE)
    for fn in (conv, scan, recurrent_checkpoint):
        setattr(fn, PROMPT_END_FLAG, True)
    gated_delta_net.causal_conv1d_update = conv
    gated_delta_net.gated_delta_rule_fn = scan
    generator_module.Generator.recurrent_checkpoint = recurrent_checkpoint


def checkpoint_settings(cache_gb: float, page_size: int) -> dict:
    """The Generator's recurrent-checkpoint arguments: the host-RAM budget (exllamav3's LRU counts each checkpoint at
    its size) and a checkpoint at every page boundary of an answer, so the one before its end is always there."""
    return {"recurrent_cache_size": int(cache_gb * 1000**3), "recurrent_checkpoint_interval": page_size}


def checkpoint_stats(generator, prompt_end: PromptEndCheckpoints | None) -> dict:
    """The recurrent cache's occupancy and evictions, and the prompt-end checkpoints made and dropped."""
    rc = generator.recurrent_cache
    if rc is None:
        return {}
    out = {"count": len(rc), "bytes": rc.current_size, "budget_bytes": rc.max_size, "evictions": rc.metrics.get("stash_evictions", 0)}
    if prompt_end is not None:
        out.update(prompt_end_made=prompt_end.made, prompt_end_dropped=prompt_end.dropped)
    return out


def set_prompt_end_checkpoints(generator, on: bool) -> PromptEndCheckpoints | None:
    """Checkpoint ``generator``'s prompts at their last page boundary inside single-pass prefill (``on``); returns
    the capture (its counters), or None."""
    from exllamav3.constants import PAGE_SIZE

    if not on or generator.recurrent_cache is None:
        setattr(generator.cache, PROMPT_END_FLAG, None)
        return None
    install_prompt_end_checkpoints()
    capture = PromptEndCheckpoints(PAGE_SIZE)
    setattr(generator.cache, PROMPT_END_FLAG, capture)
    return capture
