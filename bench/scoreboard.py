"""The results of ``bench/compare.py``: their schema, the physical bounds, and the figures derived from them.

Pure arithmetic on the results JSON (no GPU, no exllamav3): ``compare.py`` calls it to finish a run, and
``chart.py`` and ``readme_measured.py`` read through it.

Results (``schema: glm53-compare/1``), top level: ``date`` (UTC ISO), ``command`` (to reproduce), ``argv``,
``machine{gpu, gpu_memory_gb, driver, cpu, cores_logical, cores_physical, ram_gb}``, ``versions{python, torch,
cuda, exllamav3, glm53, git}``, ``checkpoint{preset, seed, moe_layers, experts, top_k, dir, bytes,
routed_expert_bytes, expert_bytes, profile_hit_rate, reused, calibrated}``, ``settings{...}`` (what every arm
ran with), ``shm{...}``, ``bandwidth{pcie_h2d_gbs, pcie_zero_copy_read_gbs, dram_read_gbs, dram_threads,
hbm_copy_gbs}``, ``arms[]``, ``spread{}``, ``bounds{}``, ``goals[]``, ``chart``.

An arm: ``name``, ``run`` (1, 2, ... for a repeated arm), ``status`` (``ok``, ``error``, ``timeout``,
``not available``), ``reason``/``error_tail`` when not ok, ``seconds``; when ok ``load_seconds``,
``decode_tok_s`` (median of ``decode_runs``), ``prefill_tok_s{"512": tok/s, ...}`` (median of
``prefill_runs``), ``hit_rate``, ``oracle_hit_rate`` (null where the arm has no expert cache),
``host_rss_peak_gb``, ``host_rss_steady_gb``, ``host_pss_steady_gb``, ``mem_available_drop_gb``,
``pinned_bytes``, ``vram_max_allocated_gb``, ``vram_device_used_gb``, ``engine_stats``; the project arms also
``preflight_ram_gb`` (what ``glm53 serve``'s preflight says the arm needs).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

from glm53 import cost_model as cm

SCHEMA = "glm53-compare/1"
ARMS = ("stock-vram", "stock-mcs", "stock-mcs-pa", "exact", "fast")  # a full comparison (the default run)
STOCK_OFFLOAD = ("stock-mcs", "stock-mcs-pa")
PREFETCH_ARMS = ("exact-prefetch", "exact-oracle")  # exact mode with GLM53_PREFETCH: the router's prediction, the oracle's
ALL_ARMS = ARMS + PREFETCH_ARMS
PROJECT_ARMS = ("exact", "fast", *PREFETCH_ARMS)
STATUSES = ("ok", "error", "timeout", "not available")
PREFILL_LENGTHS = (512, 4096)

_REQUIRED = {
    "": ("schema", "date", "command", "machine", "versions", "checkpoint", "settings", "bandwidth", "arms", "bounds"),
    "machine": ("gpu", "driver", "cpu", "cores_logical", "cores_physical", "ram_gb"),
    "checkpoint": ("preset", "seed", "moe_layers", "experts", "top_k", "bytes", "routed_expert_bytes", "expert_bytes"),
    "bandwidth": ("pcie_h2d_gbs", "pcie_zero_copy_read_gbs", "dram_read_gbs", "hbm_copy_gbs"),
}
_ARM_OK = ("load_seconds", "decode_tok_s", "decode_runs", "prefill_tok_s", "hit_rate", "oracle_hit_rate",
           "host_rss_peak_gb", "host_rss_steady_gb", "vram_max_allocated_gb", "vram_device_used_gb")


def validate(results: Mapping) -> list[str]:
    """What is wrong with a results document (an empty list when nothing is)."""
    problems = []
    for section, keys in _REQUIRED.items():
        where = results if not section else results.get(section)
        if not isinstance(where, Mapping):
            problems.append(f"{section} is missing or not an object")
            continue
        problems += [f"{section + '.' if section else ''}{k} is missing" for k in keys if k not in where]
    if results.get("schema") not in (None, SCHEMA):
        problems.append(f"schema is {results.get('schema')!r}, expected {SCHEMA!r}")
    for i, arm in enumerate(results.get("arms") or []):
        label = f"arms[{i}] ({arm.get('name')})"
        if arm.get("name") not in ALL_ARMS:
            problems.append(f"{label}: unknown arm name")
        if arm.get("status") not in STATUSES:
            problems.append(f"{label}: status {arm.get('status')!r} is not one of {', '.join(STATUSES)}")
        elif arm["status"] == "ok":
            problems += [f"{label}: {k} is missing" for k in _ARM_OK if k not in arm]
            rate = arm.get("decode_tok_s")
            if not isinstance(rate, (int, float)) or rate <= 0:
                problems.append(f"{label}: decode_tok_s must be a positive number")
        elif not (arm.get("reason") or arm.get("error_tail")):
            problems.append(f"{label}: status {arm['status']} without a reason or error_tail")
    return problems


def ok_runs(results: Mapping, name: str) -> list[Mapping]:
    return [a for a in results.get("arms", []) if a.get("name") == name and a.get("status") == "ok"]


def arm_value(results: Mapping, name: str, key: str, length: int | None = None) -> float | None:
    """The median over an arm's successful runs of ``decode_tok_s`` (or ``prefill_tok_s[length]``, or any
    numeric field); None when no run has it."""
    values = []
    for run in ok_runs(results, name):
        value = run.get(key)
        if length is not None:
            value = (value or {}).get(str(length))
        if isinstance(value, (int, float)):
            values.append(float(value))
    return statistics.median(values) if values else None


def best_stock_offload(results: Mapping, key: str = "decode_tok_s", length: int | None = None) -> tuple[str, float] | None:
    """(arm, value) of the better of stock exllamav3's CPU-offload arms."""
    found = [(name, arm_value(results, name, key, length)) for name in STOCK_OFFLOAD]
    found = [(n, v) for n, v in found if v is not None]
    return max(found, key=lambda x: x[1]) if found else None


def profile_hit_rate(stats: Mapping[str, Iterable[float]], gpu_experts: int) -> float:
    """Share of picks a static hot-first placement of ``gpu_experts`` experts per layer serves from VRAM, under
    an ``EXL3_MOE_CPU_SPLIT_STATS`` routing profile (per-layer pick counts), averaged over layers (each layer
    routes the same number of picks per token)."""
    shares = []
    for counts in stats.values():
        ordered = sorted((float(c) for c in counts), reverse=True)
        total = sum(ordered)
        if total > 0:
            shares.append(sum(ordered[:gpu_experts]) / total)
    if not shares:
        raise ValueError("the routing profile has no picks")
    return sum(shares) / len(shares)


def overlap_bound(t_allvram_s: float, hit_rate: float, top_k: int, moe_layers: int, expert_bytes: float,
                  link_gbs: float) -> dict:
    """Decode rate when the misses' reads overlap all the rest of the step (prefetch's ceiling): ``1 / max(t_allvram,
    (1 - hit_rate) * top_k * moe_layers * expert_bytes / link)``."""
    miss_bytes = (1.0 - hit_rate) * top_k * moe_layers * expert_bytes
    seconds = max(t_allvram_s, miss_bytes / (link_gbs * 1e9))
    return {"miss_bytes_per_token": miss_bytes, "seconds_per_token": seconds, "tok_s": 1.0 / seconds}


def decode_bound(t_allvram_s: float, hit_rate: float, top_k: int, moe_layers: int, expert_bytes: float,
                 link_gbs: float) -> dict:
    """Decode rate when every miss is read once over a link of ``link_gbs`` GB/s on top of the all-VRAM step: the cost
    model's exact-mode step at ``(1 - hit_rate) * top_k`` misses a layer."""
    misses = (1.0 - hit_rate) * top_k
    step = cm.Step(fixed_s=t_allvram_s, moe_layers=moe_layers, misses=misses, hits=top_k - misses)
    seconds = cm.exact_step_s(step, cm.Costs({1: 1.0}, 0.0, expert_bytes / (link_gbs * 1e9), 0.0))
    return {"miss_bytes_per_token": misses * moe_layers * expert_bytes, "seconds_per_token": seconds, "tok_s": 1.0 / seconds}


def _decode_hit_rate(results: Mapping, name: str, key: str) -> float | None:
    values = [r[key] for r in ok_runs(results, name) if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def bounds(results: Mapping) -> dict:
    """The physical bounds the results imply (``{"available": false, "reason": ...}`` where an input is missing).

    - exact: misses read over PCIe (the zero-copy read rate, else the pinned copy rate) at the measured exact-mode
      hit rate, else at the routing profile's static hot-first hit rate;
    - exact_oracle: the same at the exact arm's oracle hit rate (an ideal cache of the same size);
    - exact_overlap: the misses' reads overlapping the rest of the step (``overlap_bound``, prefetch's ceiling) at
      the exact arm's hit rate;
    - fast: the misses split between the link and the CPU tier, both busy all the time: the link's rate plus the
      CPU tier's measured rate (``cpu_tier_gbs``), capped by the host's DRAM read rate, at the fast arm's hit rate
      (else exact's);
    - fast_dram: an upper bound where the CPU tier takes part of the misses at the host's whole DRAM read rate.
    """
    allvram = arm_value(results, "stock-vram", "decode_tok_s")
    ckpt, bw = results.get("checkpoint", {}), results.get("bandwidth", {})
    link = emulated_link_gbs(results) or bw.get("pcie_zero_copy_read_gbs") or bw.get("pcie_h2d_gbs")
    link_name = "emulated" if emulated_link_gbs(results) else "pcie_zero_copy_read_gbs" if bw.get("pcie_zero_copy_read_gbs") else "pcie_h2d_gbs"
    if allvram is None:
        return {"available": False, "reason": "no successful stock-vram run (the all-VRAM step time)"}
    if not link:
        return {"available": False, "reason": "no PCIe bandwidth measurement"}
    hit, source = _decode_hit_rate(results, "exact", "hit_rate"), "exact arm, decode phase"
    if hit is None:
        hit, source = ckpt.get("profile_hit_rate"), "routing profile, static hot-first placement"
    if hit is None:
        return {"available": False, "reason": "no hit rate (no exact arm and no routing profile)"}
    shape = (ckpt["top_k"], ckpt["moe_layers"], ckpt["expert_bytes"])
    out = {
        "available": True,
        "t_allvram_ms": 1000.0 / allvram,
        "hit_rate": hit,
        "hit_rate_source": source,
        "link": link_name,
        "link_gbs": link,
        "exact": decode_bound(1.0 / allvram, hit, *shape, link),
        "exact_overlap": overlap_bound(1.0 / allvram, hit, *shape, link),
    }
    oracle = _decode_hit_rate(results, "exact", "oracle_hit_rate")
    if oracle is not None:
        out["exact_oracle"] = {**decode_bound(1.0 / allvram, oracle, *shape, link), "hit_rate": oracle}
    if bw.get("dram_read_gbs"):
        out["fast_dram"] = {**decode_bound(1.0 / allvram, hit, *shape, link + bw["dram_read_gbs"]),
                            "note": "upper bound: misses split between PCIe reads and the CPU tier at DRAM read speed"}
    cpu = cpu_tier_gbs(results)
    if cpu is not None:
        fast_hit = _decode_hit_rate(results, "fast", "hit_rate")
        fast_hit = hit if fast_hit is None else fast_hit
        rate = min(link + cpu, bw["dram_read_gbs"]) if bw.get("dram_read_gbs") else link + cpu
        out["fast"] = {**decode_bound(1.0 / allvram, fast_hit, *shape, rate), "hit_rate": fast_hit, "cpu_tier_gbs": cpu,
                       "miss_gbs": rate}
    return out


def cpu_tier_gbs(results: Mapping) -> float | None:
    """The CPU tier's expert throughput on one token (an expert's bytes over its per-expert time, which the
    engine measures at start with the worker's threads), from the fast arm's statistics; None without them."""
    for run in ok_runs(results, "fast"):
        tier = find_stats(run.get("engine_stats"), ("cpu_tier",))
        per_token = ((tier or {}).get("cpu_tier", {}).get("costs") or {}).get("cpu_expert_us") or {}
        us = per_token.get("1", per_token.get(1))
        if us:
            return results["checkpoint"]["expert_bytes"] / (us * 1e-6) / 1e9
    return None


def find_stats(stats, keys=("hits", "hit_rate")) -> dict | None:
    """The shallowest dict in an engine's statistics that holds all of ``keys`` (lists are not searched: they
    hold per-layer rows)."""
    level = [stats] if isinstance(stats, dict) else []
    while level:
        for d in level:
            if all(k in d for k in keys):
                return d
        level = [v for d in level for v in d.values() if isinstance(v, dict)]
    return None


def spread(results: Mapping) -> dict:
    """For every arm run more than once: (max - min) / mean of decode and each prefill length."""
    out = {}
    for name in ALL_ARMS:
        runs = ok_runs(results, name)
        if len(runs) < 2:
            continue
        entry = {"runs": len(runs)}
        series = {"decode_tok_s": [r["decode_tok_s"] for r in runs]}
        for n in PREFILL_LENGTHS:
            values = [(r.get("prefill_tok_s") or {}).get(str(n)) for r in runs]
            if all(isinstance(v, (int, float)) for v in values):
                series[f"prefill_{n}_tok_s"] = values
        for key, values in series.items():
            entry[key] = {"values": values, "relative": (max(values) - min(values)) / statistics.mean(values)}
        out[name] = entry
    return out


def ratios(results: Mapping, arm: Mapping) -> dict:
    """One arm run's decode rate against the best stock offload (the median of its runs) and against the
    exact-mode bound."""
    decode = arm.get("decode_tok_s") if arm.get("status") == "ok" else None
    best = best_stock_offload(results)
    b = results.get("bounds") or {}
    return {
        "vs_stock_offload": decode / best[1] if decode is not None and best else None,
        "vs_bound": decode / b["exact"]["tok_s"] if decode is not None and b.get("available") else None,
    }


def goals(results: Mapping) -> list[dict]:
    """The exact-mode goals (issue 5) and the fast-mode goals (issue 29: they depend on the run's conditions: a link
    emulated at some rate (``link_emulation``), a CPU hog, or neither), each with its value, its target and whether it
    is met (None: not measurable in this run)."""
    decode = arm_value(results, "exact", "decode_tok_s")
    best = best_stock_offload(results)
    best_512 = best_stock_offload(results, "prefill_tok_s", 512)
    b = results.get("bounds") or {}
    rows = [
        ("exact decode / best stock offload decode", decode, best[1] if best else None, 1.2),
        ("exact decode / exact bound", decode, b["exact"]["tok_s"] if b.get("available") else None, 0.85),
        ("exact prefill 4096 / stock all-VRAM prefill 4096", arm_value(results, "exact", "prefill_tok_s", 4096),
         arm_value(results, "stock-vram", "prefill_tok_s", 4096), 0.7),
        ("exact prefill 512 / best stock offload prefill 512", arm_value(results, "exact", "prefill_tok_s", 512),
         best_512[1] if best_512 else None, 5.0),
    ]
    fast = arm_value(results, "fast", "decode_tok_s")
    if fast is not None:
        emulated, hogged = emulated_link_gbs(results), bool(results.get("cpu_hog"))
        condition = f"link emulated at {emulated:g} GB/s" if emulated else "CPU hog" if hogged else "full link"
        rows.append((f"fast decode / exact decode ({condition})", fast, decode, fast_target(emulated, hogged)))
        if emulated:
            rows.append((f"fast decode / best stock offload decode ({condition})", fast, best[1] if best else None, 2.0))
        if cpu_tier_gbs(results) is not None:  # a fast arm whose CPU tier stayed off has no fast bound
            rows.append((f"fast decode / fast bound ({condition})", fast, b["fast"]["tok_s"] if b.get("fast") else None, 0.8))
        exact_streams = (ok_runs(results, "exact") or [{}])[0].get("decode_streams_tok_s") or {}
        fast_streams = (ok_runs(results, "fast") or [{}])[0].get("decode_streams_tok_s") or {}
        for n in sorted(set(exact_streams) & set(fast_streams), key=int):
            rows.append((f"fast / exact, {n} streams batched ({condition})", fast_streams[n], exact_streams[n], 1.0))
    for arm, target in (("exact-oracle", 1.3), ("exact-prefetch", 1.15)):  # issue 20
        value = arm_value(results, arm, "decode_tok_s")
        if value is not None:
            rows.append((f"{arm} decode / exact decode", value, decode, target))
    prefetched = arm_value(results, "exact-oracle", "decode_tok_s") or arm_value(results, "exact-prefetch", "decode_tok_s")
    if prefetched is not None:
        rows.append(("exact-oracle (else exact-prefetch) decode / exact overlap bound", prefetched,
                     b["exact_overlap"]["tok_s"] if b.get("available") else None, 0.85))
    out = []
    for label, value, reference, target in rows:
        ratio = value / reference if value is not None and reference else None
        out.append({"goal": label, "ratio": ratio, "target": target, "met": None if ratio is None else ratio >= target})
    return out


def emulated_link_gbs(results: Mapping) -> float | None:
    """The emulated link's rate the project arms ran at (None: the full link)."""
    return (results.get("link_emulation") or {}).get("target_gbs")


def fast_target(emulated_gbs: float | None, hogged: bool) -> float:
    """Fast mode's goal against exact mode (issue 29): 1.8x on a link of 12.5 GB/s or slower, 1.4x up to 25 GB/s, 1.15x
    on the full link, and never below 0.98x with every CPU busy or on a faster emulated link."""
    if emulated_gbs is not None:
        return 1.8 if emulated_gbs <= 12.5 else 1.4 if emulated_gbs <= 25 else 0.98
    return 0.98 if hogged else 1.15


def finish(results: dict) -> dict:
    """Fill in the derived sections (``bounds``, ``spread``, ``goals``) of a results document in place."""
    results["bounds"] = bounds(results)
    results["spread"] = spread(results)
    results["goals"] = goals(results)
    return results
