"""How much host RAM the routed experts may take: ``GLM53_HOST_RAM_GB``, else what the host has (MemAvailable, or the
cgroup's room where that is less) less what the rest of the process needs (``cost_model.host_ram_needed`` without the
store). One place for preflight, which reports it, and the engine's start, which sizes the RAM tier from it.
"""

from __future__ import annotations

import os

from .. import cost_model as cm
from .. import host
from ..config import GB, Settings


def cpu_tier_threads(settings: Settings) -> int:
    """The CPU tier's threads as the RAM need counts them (``auto`` counts every CPU: it errs on the safe side)."""
    if settings.ct_threads:
        return settings.ct_threads
    if isinstance(settings.ct_cpus, tuple):
        return len(settings.ct_cpus)
    return os.cpu_count() or 1


def available(paths: host.HostPaths) -> tuple[int | None, str]:
    """Bytes this process may still take (MemAvailable, less where the cgroup leaves less) and a sentence saying so;
    None where MemAvailable cannot be read."""
    avail = host.meminfo(paths.meminfo).get("MemAvailable")
    if avail is None:
        return None, f"cannot read MemAvailable from {paths.meminfo}"
    text = f"{avail / 2**30:.1f} GiB available"
    cgroup = host.cgroup_memory(paths)
    if cgroup is not None:
        room = cgroup.limit - (cgroup.current or 0)
        text += f", cgroup limit {cgroup.limit / 2**30:.1f} GiB ({room / 2**30:.1f} GiB unused)"
        avail = min(avail, room)
    return avail, text


def expert_budget(settings: Settings, sign_scale_bytes: int, paths: host.HostPaths | None = None) -> tuple[int | None, str]:
    """Host bytes for routed experts, and how they were set (for messages); None: unknown (MemAvailable unreadable),
    every expert is then held as without a budget."""
    if settings.host_ram_gb is not None:
        return int(settings.host_ram_gb * GB), f"GLM53_HOST_RAM_GB={settings.host_ram_gb:g}"
    avail, _ = available(paths or host.HostPaths())
    if avail is None:
        return None, "unknown (MemAvailable unreadable)"
    budget = cm.expert_ram_budget(avail, sign_scale_bytes, settings.mode, cpu_tier_threads(settings))
    return budget, "what the process leaves"
