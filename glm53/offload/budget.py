"""The VRAM budget of the offload: how many expert-cache slots fit once the model, its caches and the reserve have
what they need, and how much prefill staging may still allocate later.

Everything on the card counts as used (this process's model, KV cache and CUDA context, and other processes), under
``GLM53_VRAM_LIMIT_GB`` when it is set, less ``GLM53_EC_RESERVE_GB`` kept for activations.
"""

from __future__ import annotations

import torch

from ..config import GB, Settings


def cache_slots(settings: Settings, block_bytes: int, total_experts: int, device: torch.device) -> tuple[int, dict]:
    """Slots for the cache: what is free under the VRAM budget, in expert blocks of ``block_bytes``, capped by
    ``ec_cache_experts`` (of ``total_experts``); and the budget's figures (for ``/stats`` and :func:`headroom`)."""
    free, total = torch.cuda.mem_get_info(device)
    limit = int(settings.vram_limit_gb * GB) if settings.vram_limit_gb else total
    used = total - free  # everything on the card: this process (model, KV cache, CUDA context) and others
    available = max(0, min(free, limit - used) - int(settings.ec_reserve_gb * GB))
    slots = available // block_bytes
    cap = experts_cap(settings.ec_cache_experts, total_experts)
    if cap is not None:
        slots = min(slots, cap)
    budget = {"device_total_bytes": total, "limit_bytes": limit, "used_before_cache_bytes": used,
              "reserve_bytes": int(settings.ec_reserve_gb * GB), "available_bytes": available}
    return int(slots), budget


def experts_cap(value, total_experts: int) -> int | None:
    """``GLM53_EC_CACHE_EXPERTS`` as a number of experts: None for ``auto`` (no cap), a percentage of every
    expert, or the count itself."""
    if value == "auto":
        return None
    if isinstance(value, str) and value.endswith("%"):
        return round(total_experts * float(value[:-1]) / 100)
    return int(value)


def headroom(device: torch.device, budget: dict) -> int:
    """Bytes the project may still allocate under the VRAM budget, keeping the reserve for activations (memory
    torch's allocator holds but does not use, such as lent cache chunks, counts as free)."""
    free, total = torch.cuda.mem_get_info(device)
    idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    used = total - free - idle
    return max(0, min(free + idle, budget["limit_bytes"] - used) - budget["reserve_bytes"])
