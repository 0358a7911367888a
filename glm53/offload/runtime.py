"""The offload layer put together: host store, GPU expert cache, prefill staging and the elastic loan, installed
into a stock exllamav3 model through the patch points of ``patches``.

Order of use (``Exl3Backend`` does this):

    offload = Offload(settings)            # reads every expert into pinned host memory
    with offload.loading(model):           # experts answered from the host store, tables captured
        model.load(...)
    model.warmup(...)                      # before the cache: its VRAM is what is left afterwards
    offload.attach(model)                  # size and fill the cache, install the hooks

Decode (a forward of at most ``Policy.decode_rows`` rows per MoE layer): after each layer's routing, one kernel
counts hits, admits and rewrites tables (``ExpertCache.on_routing``). A large forward (prefill): the first module's
forward sees its size first; the cache lends ``ec_elastic_gb`` of its coldest slots, staging buffers are
allocated and layers 0 and 1 start copying. The next small forward gives the staging VRAM back and restores
the lent slots with the experts they held.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from ..config import Settings
from ..models.checkpoint import ROUTING_PROFILE_FILE, config_bytes
from ..progress import Progress
from ..engine.exl3 import patches
from .cache import ExpertCache, Policy
from .ec_native import Kernels
from .host_store import HostStore
from .staging import PrefillStager

log = logging.getLogger("glm53.offload")

GB = 1000**3
STAGE_MIN_ROWS = 256  # forwards with at least this many tokens stage experts (below, zero-copy reads suffice)
CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


class Offload:
    def __init__(self, settings: Settings, device: torch.device | None = None, policy: Policy | None = None,
                 progress: Progress | None = None):
        """:param progress: where reading the shards and pinning report their bytes."""
        progress = progress or Progress()
        self.settings = settings
        self.model_dir = Path(settings.model_dir)
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.policy = policy or Policy()
        self.timings: dict[str, float] = {}
        t0 = time.monotonic()
        self.store = HostStore.scan(self.model_dir)
        self.timings["store_read_s"] = round(self.store.load(progress=progress.steps("reading shards")), 2)
        t1 = time.monotonic()
        cudart = torch.cuda.cudart()

        def register(ptr: int, nbytes: int) -> None:
            err = cudart.cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes / GB:.2f} GB of expert memory failed (error {int(err)}): "
                                   "page-locked memory is limited (ulimit -l; set memlock to unlimited)")

        self.store.pin_and_map(self.device, register, patches.pinned_cuda_view, progress=progress.steps("pinning"))
        self._unregister = lambda ptr: cudart.cudaHostUnregister(ptr)
        self.timings["store_pin_s"] = round(time.monotonic() - t1, 2)
        self.timings["store_total_s"] = round(time.monotonic() - t0, 2)
        self._captured: dict[int, torch.Tensor] = {}
        self.cache: ExpertCache | None = None
        self.stager: PrefillStager | None = None
        self.fast = None  # fast mode's CPU tier (fast_tier.FastTier), when enabled
        self.cpu_tier_off_reason: str | None = None  # why GLM53_CT_ENABLE=auto left it off
        self._removers: list = []
        self._prefill = False
        log.info("host store: %d layers x %d experts, %.2f GB pinned in %.1f s", self.store.num_layers, self.store.num_experts,
                 self.store.arena_bytes / GB, self.timings["store_total_s"])

    # ---- loading

    def loading(self, model):
        """Context for ``model.load``: experts from the host store, gate/up tables captured."""
        from contextlib import ExitStack

        stack = ExitStack()
        stack.enter_context(patches.expert_trellises_from(model.config, self.store.trellis_view))
        stack.enter_context(patches.capture_gate_up_tables(self._captured))
        return stack

    # ---- attaching

    def attach(self, model) -> None:
        patches.check_offload_internals(model)
        layers = patches.moe_layers(model)
        by_key = {mlp.key: mlp for _, mlp in layers}
        if sorted(by_key) != sorted(self.store.layer_keys):
            raise RuntimeError(f"the model's MoE layers {sorted(by_key)} are not the host store's {self.store.layer_keys}")
        mlps = [by_key[k] for k in self.store.layer_keys]
        for mlp in mlps:
            if mlp.num_experts != self.store.num_experts:
                raise RuntimeError(f"{mlp.key}: {mlp.num_experts} experts, the host store has {self.store.num_experts}")
        tables = [patches.expert_tables(mlp, self._captured) for mlp in mlps]
        self._captured.clear()
        kernels = Kernels()
        slots, budget = self._cache_slots()
        profile, self.profile_source = self._profile()
        top_k = int(mlps[0].num_experts_per_tok)
        self.cache = ExpertCache(kernels, self.store, tables, slots, self.device, top_k, self.policy, profile)
        stage_bytes = int(self.settings.ec_stage_gb * GB)
        self.stager = PrefillStager(self.store, self.cache, tables, self.device, stage_bytes, STAGE_MIN_ROWS)
        self.budget = budget
        if self.settings.mode == "fast" and self.settings.ct_enable:
            self.fast = self._start_cpu_tier(mlps, kernels)
        for row, mlp in enumerate(mlps):
            if self.fast is not None:
                self._removers.append(patches.add_routing_hook(
                    mlp, lambda sel, w, z, params, _row=row: self._routed(_row, sel, w, z), with_inputs=True))
                self._removers.append(patches.wrap_routed_sum(mlp, lambda fhs, _row=row: self.fast.on_routed_sum(_row, fhs)))
            else:
                self._removers.append(patches.add_routing_hook(mlp, lambda sel, params, _row=row: self._routed(_row, sel)))
            self._removers.append(patches.wrap_forward(mlp, before=lambda x, p, _row=row: self._before_layer(_row),
                                                          after=lambda x, p, _row=row: self._after_layer(_row)))
        self._removers.append(patches.wrap_forward(patches.first_forward_module(model), before=self._forward_start))
        log.info("expert cache: %d of %d experts in VRAM (%.2f GB), profile: %s", self.cache.num_slots,
                 self.store.num_layers * self.store.num_experts, self.cache.num_slots * self.store.layout.block_bytes / GB, self.profile_source)

    def _start_cpu_tier(self, mlps, kernels):
        """Fast mode's CPU tier, or None when ``GLM53_CT_ENABLE=auto`` and the costs it measured at start give it no
        share of a decode step's misses (then it is stopped again: no threads, no pinned CPUs)."""
        from ..cpu_tier.tier import FastTier

        tier = FastTier(self.settings, self.model_dir, self.store, self.cache, mlps, self.device, kernels)
        worthwhile, why = tier.worthwhile()
        if self.settings.ct_enable == "auto" and not worthwhile:
            tier.close()
            self.cpu_tier_off_reason = f"the measured costs give it no share of the misses: {why}"
            log.info("CPU tier off (GLM53_CT_ENABLE=auto): %s; decode runs as in exact mode", self.cpu_tier_off_reason)
            return None
        log.info("CPU tier on (GLM53_CT_ENABLE=%s): %s", self.settings.ct_enable, why)
        return tier

    def _cache_slots(self) -> tuple[int, dict]:
        """Slots for the cache: what is free under the VRAM budget after the model, its caches and the reserve,
        capped by ``ec_cache_experts``."""
        free, total = torch.cuda.mem_get_info(self.device)
        limit = int(self.settings.vram_limit_gb * GB) if self.settings.vram_limit_gb else total
        used = total - free  # everything on the card: this process (model, KV cache, CUDA context) and others
        available = max(0, min(free, limit - used) - int(self.settings.ec_reserve_gb * GB))
        slots = available // self.store.layout.block_bytes
        cap = self._experts_cap()
        if cap is not None:
            slots = min(slots, cap)
        budget = {"device_total_bytes": total, "limit_bytes": limit, "used_before_cache_bytes": used,
                  "reserve_bytes": int(self.settings.ec_reserve_gb * GB), "available_bytes": available}
        return int(slots), budget

    def _vram_headroom(self) -> int:
        """Bytes the project may still allocate under the VRAM budget, keeping the reserve for activations
        (memory torch's allocator holds but does not use, such as lent cache chunks, counts as free)."""
        free, total = torch.cuda.mem_get_info(self.device)
        idle = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        used = total - free - idle
        return max(0, min(free + idle, self.budget["limit_bytes"] - used) - self.budget["reserve_bytes"])

    def _experts_cap(self) -> int | None:
        value = self.settings.ec_cache_experts
        total = self.store.num_layers * self.store.num_experts
        if value == "auto":
            return None
        if isinstance(value, str) and value.endswith("%"):
            return round(total * float(value[:-1]) / 100)
        return int(value)

    def _profile(self) -> tuple[np.ndarray | None, str]:
        """Routing profile for the warm start: the checkpoint's own, else one learned while serving, else none."""
        for source, path in (("checkpoint", self.model_dir / ROUTING_PROFILE_FILE), ("learned", self._learned_path())):
            if path is not None and path.is_file():
                try:
                    data = json.loads(path.read_text())
                    return np.array([data[k] for k in self.store.layer_keys], dtype=np.float64), f"{source} ({path})"
                except (KeyError, ValueError, TypeError) as e:
                    log.warning("ignoring routing profile %s: %s", path, e)
        return None, "none (cold start)"

    def _learned_path(self) -> Path | None:
        if self.settings.root is None:
            return None
        digest = hashlib.sha256(config_bytes(self.model_dir) + str(self.model_dir.resolve()).encode()).hexdigest()[:16]
        return Path(self.settings.root) / "profiles" / f"{digest}.json"

    # ---- hooks (run on the generator's thread, on the compute stream)

    def _forward_start(self, x, params) -> None:
        rows = x.numel() if x.dtype in (torch.int32, torch.int64) else x.shape[0] * (x.shape[1] if x.dim() > 2 else 1)
        if rows >= STAGE_MIN_ROWS:
            self._prefill = True
            if self.stager.enabled:
                headroom = self._vram_headroom()
                want = self.stager.wanted_bytes()
                if headroom < want and self.settings.ec_elastic_gb > 0 and not self.cache.lent:
                    # borrow only what staging lacks: every lent expert is read from host memory until decode
                    self.cache.lend(min(int(self.settings.ec_elastic_gb * GB), want - headroom))
                    headroom = self._vram_headroom()
                self.stager.begin(headroom)
        elif self._prefill or self.cache.lent:
            self._prefill = False
            self.stager.release()
            self.cache.restore()

    def _routed(self, row: int, selected: torch.Tensor, weights: torch.Tensor | None = None, z: torch.Tensor | None = None) -> None:
        if selected.shape[0] <= self.policy.decode_rows and not self._prefill:
            self.cache.on_routing(row, selected)
            if self.fast is not None:
                self.fast.on_routing(row, selected, weights, z)

    def _before_layer(self, row: int) -> None:
        if self.stager.active:
            self.stager.before_layer(row)

    def _after_layer(self, row: int) -> None:
        if self.stager.active:
            self.stager.after_layer(row)

    # ---- reporting and shutdown

    def stats(self) -> dict:
        out = {"host_store": self.store.describe(), "timings": self.timings}
        if self.cache is not None:
            out["cache"] = self.cache.stats()
            out["cache"]["profile"] = self.profile_source
            out["vram_budget"] = self.budget
            out["staging"] = self.stager.stats()
        if self.fast is not None:
            out["cpu_tier"] = self.fast.stats()
        elif self.cpu_tier_off_reason is not None:
            out["cpu_tier"] = {"off": self.cpu_tier_off_reason}
        return out

    def save_learned_profile(self) -> Path | None:
        path = self._learned_path()
        if path is None or self.cache is None:
            return None
        picks = self.cache.learned_profile()
        if picks.sum() == 0:
            return None
        previous = json.loads(path.read_text()) if path.is_file() else None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(merge_profile(previous, self.store.layer_keys, picks)) + "\n")
        tmp.replace(path)
        return path

    def close(self) -> None:
        try:
            self.save_learned_profile()
        except OSError as e:
            log.warning("could not save the learned routing profile: %s", e)
        for remove in reversed(self._removers):
            remove()
        self._removers.clear()
        if self.fast is not None:
            self.fast.close()
            self.fast = None
        if self.stager is not None:
            self.stager.release()
        self.cache = None
        torch.cuda.synchronize(self.device)
        self.store.unpin(self._unregister)


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
