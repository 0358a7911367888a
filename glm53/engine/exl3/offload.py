"""The offload's start on an exllamav3 model, read top to bottom (``start_offload``); each step is one call into
the module that owns it:

1. scan      ``HostStore.scan``: where every routed expert's trellises are, from the safetensors headers alone;
2. read      ``HostStore.load``: all of them into host memory, once (the single copy the GPU and the CPU tier use);
3. pin       ``HostStore.pin_and_map``: page-locked and mapped, so the GPU reads an expert in place (zero-copy);
             where the experts' RAM budget (``offload.ram_budget``) is below the store, steps 2-3 are instead a RAM
             tier's arena, pinned (``offload.ram_tier``), its policy slots read from disk at step 6, and the tier's
             part (``offload.tiered``) makes every pick readable before its layer runs (and tells the CPU tier where
             it put each); prefetch is then off;
4. attach    ``patches.load_offloaded``: the model loads with its experts answered from the host store, which
             gives its MoE layers and their expert pointer tables; then exllamav3's warm-up;
   link      ``offload.link.start``: the host link every part below tells what it moved (measured first when
             ``GLM53_LINK_EMULATE_GBS`` emulates a slower one);
5. size      ``budget.cache_slots``: the cache slots the VRAM budget leaves after the model, its caches and the
             warm-up, less the prefetch pool's (``GLM53_PREFETCH``: the settings refuse it where the CPU tier may
             run, so whether it runs is known here);
6. fill      ``ExpertCache``: the slots partitioned between the layers and filled by the routing profile
             (``profile.warm_start``);
7. staging   ``PrefillStager``: prefill's copies of the next layer's missing experts (beside a RAM tier, read
             from disk a layer ahead by ``offload.tier_feed``);
8. CPU tier  ``cpu_tier.tier.start`` (fast mode): the tier, or the reason ``GLM53_CT_ENABLE=auto`` leaves it off;
             beside a RAM tier it reads the experts in the tier's arena, where the tier's part puts them;
9. prefetch  ``offload.prefetch.Prefetcher`` (``GLM53_PREFETCH``): its pool's slots were taken from the cache's
             at step 5;
10. hooks    ``patches.hook_offload``: the running offload (``offload.runtime.Offload``, calling its parts: prefetch,
             the cache, the CPU tier) on every MoE layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from ...config import GB, Settings
from ...cpu_tier import tier as cpu_tier
from ...offload import budget, link, prefetch, profile
from ...offload.cache import ExpertCache, Policy
from ...offload.ec_native import Kernels
from ...models import checkpoint
from ...offload import ram_budget, ram_tier
from ...offload.disk import DiskReader
from ...offload.host_store import HostStore, cuda_register, cuda_unregister
from ...offload.ram_tier import RamTier, TierPolicy
from ...offload.tiered import TieredHome
from ...offload.prefetch import Prefetcher
from ...offload.runtime import STAGE_MIN_ROWS, Offload
from ...offload.staging import PrefillStager
from ...progress import Progress
from . import patches

log = logging.getLogger(__name__)


def start_offload(settings: Settings, model, load: Callable[[], None], warmup: Callable[[], None],
                  progress: Progress | None = None, policy: Policy | None = None) -> Offload:
    """Start the offload on ``model`` (made, not loaded), running its ``load`` and ``warmup`` where they belong.

    :param progress: where the start reports its phases (reading shards, pinning, the model's load and warm-up,
        building the cache).
    :raise InternalsChanged: exllamav3 is not the version the patch points were written against, or they moved.
    :raise ValueError, OSError: a checkpoint the host store cannot read. :raise RuntimeError: pinning failed, or the
        model's MoE layers are not the checkpoint's.
    """
    progress = progress or Progress()
    policy = policy or Policy.from_settings(settings)
    device = torch.device("cuda", torch.cuda.current_device())
    patches.check_version()  # before 125 GB are read for patch points that would not fit
    t0 = time.monotonic()
    store = HostStore.scan(settings.model_dir)                                                  # 1. scan
    tier = _ram_tier(settings, store)
    if tier is None:
        timings = {"store_read_s": round(store.load(progress=progress.steps("reading shards")), 2)}  # 2. read
        t1 = time.monotonic()
        store.pin_and_map(device, cuda_register, patches.pinned_cuda_view, progress=progress.steps("pinning"))  # 3. pin
    else:  # 2-3. the RAM tier's arena, pinned; the experts are read from disk once the cache is sized (step 6)
        timings = {"store_read_s": 0.0}
        t1 = time.monotonic()
        arena = tier.pin(cuda_register, cuda_unregister, lambda host: patches.pinned_cuda_view(host, device.index or 0))
        block = store.layout.block_bytes
        window = slice(tier.plan.policy_slots * block, (tier.plan.policy_slots + tier.plan.window_slots) * block)
        store.alias_window(arena[window], torch.from_numpy(tier.arena)[window])
    timings.update(store_pin_s=round(time.monotonic() - t1, 2), store_total_s=round(time.monotonic() - t0, 2))
    log.info("host store: %d layers x %d experts, %.2f GB %s in %.1f s", store.num_layers, store.num_experts,
             store.arena_bytes / GB, "pinned" if tier is None else f"on disk, a RAM tier of {tier.plan.bytes / GB:.2f} GB pinned",
             timings["store_total_s"])
    layers = patches.load_offloaded(model, store, load)                                         # 4. attach
    warmup()  # before the cache: its VRAM is what is left afterwards
    progress.phase("building the cache")
    kernels = Kernels()
    host_link = link.start(settings, kernels, store, device)  # measured (when it emulates) before the VRAM is counted
    total = store.num_layers * store.num_experts
    slots, vram = budget.cache_slots(settings, store.layout.block_bytes, total, device)         # 5. size
    pool = settings.prefetch_slots if settings.prefetch else 0
    slots = max(0, slots - pool)  # the prefetch pool's slots come out of the cache's
    warm, profile_source = profile.warm_start(settings.model_dir, settings.root, store.layer_keys)
    if tier is not None:  # its policy slots take the hottest experts after the cache's, read from disk now
        t2 = time.monotonic()
        tier.start(_profile_or_flat(warm, store), layers.top_k, min(slots, total), TierPolicy.from_settings(settings))
        timings["ram_tier_read_s"] = round(time.monotonic() - t2, 2)
    cache = ExpertCache(kernels, store, layers.tables, slots, device, layers.top_k, policy, warm, host_link, ram_tier=tier)  # 6. fill
    home = None if tier is None else TieredHome(tier, cache, device, max_picks=layers.top_k * settings.chunk_size,
                                                routers=patches.routers(layers) if tier.plan.ahead_slots else None,
                                                write_back=policy if settings.ram_tier_write_back else None)
    # 7. staging: beside a RAM tier, from its slots and from disk through its window, a layer ahead (``tier_feed``)
    stager = PrefillStager(store, cache, layers.tables, device, int(settings.ec_stage_gb * GB), STAGE_MIN_ROWS, tiered=home)
    cpu, off_reason = _cpu_tier(settings, store, cache, layers, device, kernels, tier)         # 8. CPU tier
    if cpu is not None and home is not None:
        home.on_rehome.append(cpu.repoint)  # the worker reads each expert where the RAM tier's part put it
    prefetcher = _prefetch(settings, kernels, cache, layers, device, policy)                    # 9. prefetch
    # routed's order: prefetch (the cache's step waits for its copies), the cache, the CPU tier (splits the misses left);
    # the RAM tier's part acts before all of them, on every forward (``Offload.routed``)
    parts = [part for part in (home, prefetcher, cache, cpu) if part is not None]
    offload = Offload(settings, store, cache, stager, device=device, policy=policy, vram=vram, profile_source=profile_source,
                      timings=timings, parts=parts, cpu_tier_off_reason=off_reason)
    offload.removers += patches.hook_offload(model, layers, offload)                           # 10. hooks
    log.info("expert cache: %d of %d experts in VRAM (%.2f GB), profile: %s", cache.num_slots, total,
             cache.num_slots * store.layout.block_bytes / GB, profile_source)
    progress.finish()
    return offload


def _ram_tier(settings: Settings, store: HostStore) -> RamTier | None:
    """The RAM tier when the experts' RAM budget (``offload.ram_budget``) is below the host store, else None.

    :raise RamBudgetError: a budget below one layer's experts. :raise RuntimeError: prefetch asked for beside it.
    """
    sign_scale = checkpoint.expert_bytes(settings.model_dir).sign_scale
    budget, given = ram_budget.expert_budget(settings, sign_scale)
    if budget is None:
        return None
    tier_plan = ram_tier.plan(store, budget, what=given, ahead=settings.ram_tier_read_ahead)
    if tier_plan is None:
        return None
    if settings.prefetch:
        raise RuntimeError(f"GLM53_PREFETCH=1 needs every routed expert in host RAM; {given} gives {budget / GB:.1f} GB of the "
                           f"{store.arena_bytes / GB:.1f} GB they take: unset GLM53_PREFETCH or give the experts more RAM")
    reader = DiskReader(store.shard_files(), threads=settings.disk_threads, piece_bytes=settings.disk_piece_kb * 1024)
    log.info("RAM tier: %s gives %.1f of the %.1f GB of routed experts: %d policy slots (%.0f %%) + one layer's window; the rest "
             "are read from disk (%s) when picked", given, budget / GB, store.arena_bytes / GB, tier_plan.policy_slots,
             100 * tier_plan.policy_slots / (store.num_layers * store.num_experts),
             reader.describe())
    return RamTier(store, reader, tier_plan)


def _profile_or_flat(warm, store: HostStore):
    """The warm-start profile, or a flat one where there is none (the RAM tier's placement then takes experts in order)."""
    return np.ones((store.num_layers, store.num_experts)) if warm is None else warm


def _prefetch(settings: Settings, kernels, cache, layers: patches.MoeLayers, device, policy) -> Prefetcher | None:
    """The decode's predictive prefetch when ``GLM53_PREFETCH`` asks for it (never beside the CPU tier, whose split
    would count a prefetched expert as a miss: ``config.load`` refuses that combination)."""
    if not settings.prefetch:
        return None
    log.info("prefetch: %d VRAM slots, the router's top %d + %d predicted per token%s", settings.prefetch_slots,
             layers.top_k, settings.prefetch_extra, ", the first MoE layer's at each step's start" if settings.prefetch_lead else "")
    return prefetch.from_settings(settings, kernels, cache, patches.routers(layers), layers.top_k, device, policy)


def _cpu_tier(settings: Settings, store, cache, layers: patches.MoeLayers, device, kernels, ram_tier: RamTier | None):
    """Fast mode's CPU tier on this model: ``(tier, None)``, or ``(None, why it is off)`` (None, None outside it).
    Beside a RAM tier it reads each expert in the tier's arena, where the RAM tier's part makes every pick readable
    before the layer's split."""
    if settings.mode != "fast":
        return None, None
    if not settings.ct_enable:
        log.info("fast mode: the CPU tier is off (GLM53_CT_ENABLE=0): experts are served as in exact mode, with the "
                 "one-pass prefill")
        return None, None
    patches.check_cpu_tier_fits(layers)
    fallbacks = [patches.fused_experts(mlp) for mlp in layers.mlps]
    return cpu_tier.start(settings, store, cache, device, kernels, fallbacks, layers.top_k, layers.act_limit, ram_tier=ram_tier)
