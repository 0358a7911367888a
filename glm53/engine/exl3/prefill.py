"""The generator's patch points, written against exllamav3 1.6.5 (``patches.EXLLAMAV3_VERSION``, checked by
``patches.check_version`` before a model loads; each install below checks the signatures it wraps, and
``tests/engine/exl3/test_single_pass_prefill.py`` checks what the wrappers rely on against 1.6.5's own source):

- ``exllamav3.generator.job.Job.prefill`` and ``Job.hash_completed_page`` (wrapped, see ``install_single_pass_prefill``):
  a generator flagged by ``set_single_pass_prefill`` does not split a recurrent model's prompt before its last page.
- ``exllamav3.modules.gated_delta_net.causal_conv1d_update`` and ``.gated_delta_rule_fn`` (module globals the
  recurrent layer's forward calls, wrapped) and ``Generator.recurrent_checkpoint`` (wrapped), with
  ``GDNState.position / slot / base_row / cache``, ``GDNLayerState.conv_state / recurrent_state``, the job's
  ``sequences[0].allocated_pages[i].phash / kv_position``, ``last_recurrent_checkpoint_pos`` and
  ``RecurrentCache.put`` (its ``len``, ``current_size``, ``max_size``, ``metrics`` for /stats), whose checkpoint layout
  (``PairedState.stash``: position, checkpoint_size, target -> {layer: (state row, conv window)}) they build: see
  ``install_prompt_end_checkpoints``.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager

import torch

from ...config import GB
from .patches import InternalsChanged


# ---- the prompt's last page (exllamav3/generator/job.py, Job.prefill)

# For a recurrent model, stock prefill ends a forward at the prompt's last page boundary and runs the rest as a
# second forward, to stash a recurrent-state checkpoint there. Each forward of an offloaded model streams every
# non-resident expert over PCIe once, whatever its length, so the split doubles a prompt's time to first token.
#
# Stock Job.prefill reads the generator's recurrent cache at three places: a guard that skips the partial-page copy
# for recurrent models (``... and self.generator.recurrent_cache is None``), the guard of the last-page split
# (``if self.generator.recurrent_cache is not None``) and the stash after that split (reached only through it).
# For a flagged generator the job runs stock prefill with the recurrent cache hidden, which skips the split and its
# stash, and with a page table that offers the partial-page copy no page, so that copy still does nothing; the one
# method prefill calls that reads either, hash_completed_page (it moves a checkpoint to a page's final hash), sees
# the real ones. Everything else prefill reads is the generator's and the page table's own.
SINGLE_PASS_FLAG = "glm53_single_pass_prefill"
PREFILL_PARAMS = ("self", "results", "chunk_size")
HASH_PARAMS = ("self", "seq", "page_idx")


class _RecurrentCacheHidden:
    """A job's generator with no recurrent cache (Job.prefill's last-page split and its stash are skipped)."""

    recurrent_cache = None

    def __init__(self, generator):
        self.real = generator

    def __getattr__(self, name):
        return getattr(self.real, name)


class _NoPagesToCopy:
    """A page table whose pages the partial-page copy does not see (``all_pages``; the rest is the table's)."""

    all_pages = ()

    def __init__(self, pagetable):
        self.real = pagetable

    def __getattr__(self, name):
        return getattr(self.real, name)


@contextmanager
def _seen(job, generator, pagetable):
    """``job.generator`` and ``job.pagetable`` are ``generator`` and ``pagetable`` inside, what they were after."""
    before = job.generator, job.pagetable
    job.generator, job.pagetable = generator, pagetable
    try:
        yield
    finally:
        job.generator, job.pagetable = before


def install_single_pass_prefill() -> None:
    """Wrap ``Job.prefill`` (and ``Job.hash_completed_page``) so that a flagged generator's jobs skip the last-page
    split (idempotent; unflagged generators run exactly the stock methods). :raise InternalsChanged: a signature moved."""
    from exllamav3.generator import job as job_module

    cls = job_module.Job
    if getattr(cls.prefill, SINGLE_PASS_FLAG, False):
        return
    for name, expected in (("prefill", PREFILL_PARAMS), ("hash_completed_page", HASH_PARAMS)):
        found = tuple(inspect.signature(getattr(cls, name)).parameters)
        if found != expected:
            raise InternalsChanged(f"exllamav3 Job.{name} takes {found}, glm53 expects {expected}; the single-pass prefill "
                                   "patch point moved")
    stock_prefill, stock_hash = cls.prefill, cls.hash_completed_page

    @functools.wraps(stock_prefill)
    def prefill(self, results, chunk_size=None):
        if not getattr(self.generator, SINGLE_PASS_FLAG, False):
            return stock_prefill(self, results, chunk_size)
        with _seen(self, _RecurrentCacheHidden(self.generator), _NoPagesToCopy(self.pagetable)):
            return stock_prefill(self, results, chunk_size)

    @functools.wraps(stock_hash)
    def hash_completed_page(self, seq, page_idx):
        if not isinstance(self.generator, _RecurrentCacheHidden):
            return stock_hash(self, seq, page_idx)
        with _seen(self, self.generator.real, self.pagetable.real):
            return stock_hash(self, seq, page_idx)

    for fn in (prefill, hash_completed_page):
        setattr(fn, SINGLE_PASS_FLAG, True)
    cls.prefill, cls.hash_completed_page = prefill, hash_completed_page


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
    return {"recurrent_cache_size": int(cache_gb * GB), "recurrent_checkpoint_interval": page_size}


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
