"""``glm53 plan``: what the full GLM-5.3-Flash would do on a machine, from the one cost model (``glm53.cost_model``):
decode at one and four streams and an 8k prefill, in exact and fast mode, the host RAM each needs, the settings it
would pick, what bounds each mode, and the model's error band as ``bench.predict`` measured it on recorded runs.

The machine is a named preset (the H200 test host, the original project's RTX 3090 rig with its published figures
beside the projection, a PCIe 4 workstation), a described rig (``--gpu``, ``--link-gbs``, ``--cores``, ``--isa``,
``--dram-gbs``, ``--ram-gib``, ``--disk-gbs``: the CPU tier's rate then follows from the measured rate a core of the ISA's kernel),
or, by default, this host: its CPU tier's kernel timed on its own cores, its DRAM read rate, its RAM, and the GPU and
PCIe link ``nvidia-smi`` reports. Where the rig's RAM cannot hold every routed expert, the projection has a RAM tier:
the RAM left after the process holds the next-hottest experts after the VRAM's, and the rest are read from disk at
``--disk-gbs`` before the link reads them. Every figure says where it came from; a projection is never a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

import numpy as np

from . import cost_model as cm
from . import host

# ---- this host, measured


def dram_read_gbs(nbytes: int = 1 << 30, threads: int | None = None) -> float:
    """Host threads summing disjoint slices of one buffer (NumPy releases the GIL): the best of three passes."""
    threads = threads or os.cpu_count() or 1
    buf = np.ones(nbytes // 8, dtype=np.int64)
    slices = np.array_split(buf, threads)
    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(4):  # the first pass warms the pool and the pages
            t0 = time.perf_counter()
            list(pool.map(np.sum, slices))
            best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def random_linear(rng: np.random.Generator, n_in: int, n_out: int, bits: int = 3):
    """A projection of random EXL3 trellis bits (any bits decode to valid weights) and random sign/scale vectors, as
    the CPU tier's kernel takes it (``cpu_tier.kernel.Linear``): what it is timed on without a checkpoint."""
    from .cpu_tier import kernel as ce

    trellis = np.frombuffer(rng.bytes(n_in * n_out * bits // 8), dtype=np.int16).reshape(n_in // 16, n_out // 16, 16 * bits)
    return ce.Linear(trellis, rng.choice([-1.0, 1.0], n_in).astype(np.float16),
                     (rng.choice([-1.0, 1.0], n_out) / math.sqrt(n_in)).astype(np.float16))


def local_cpu_figures(experts: int = 16, seed: int = 0) -> tuple[dict[int, float], dict[int, float], int, str]:
    """The CPU tier's kernel timed on this host as the tier times it at start (``split.measure_cpu``), on random
    experts of GLM-5.3-Flash's shape and the threads ``GLM53_CT_CPUS=auto`` gives it: (per expert, per job, threads,
    ISA). :raise NativeBuildError: no CPU library (``make native``)."""
    from .config import load
    from .cpu_tier import kernel as ce
    from .cpu_tier.split import measure_cpu

    rng = np.random.default_rng(seed)
    table = [(random_linear(rng, 4096, 2048), random_linear(rng, 4096, 2048), random_linear(rng, 2048, 4096)) for _ in range(experts)]
    pool, caller = ce.Pool.for_caller(load([], {}), spin_us=1000)
    affinity = os.sched_getaffinity(0)
    if caller is not None:
        os.sched_setaffinity(0, {caller})
    try:
        with pool:
            per_expert, per_job = measure_cpu(table, act_limit=10.0, pool=pool, tokens=(1, 4), batch=8, repeats=2, codebook="int16")
    finally:
        os.sched_setaffinity(0, affinity)
    return per_expert, per_job, pool.threads + (caller is not None), ce.available_isas()[-1]


def local_rig(paths: host.HostPaths | None = None) -> cm.Rig:
    """This host's figures, measured where a measurement takes seconds, else read (nvidia-smi, /proc/meminfo)."""
    paths = paths or host.HostPaths()
    per_expert, per_job, threads, isa = local_cpu_figures()
    dram = dram_read_gbs()
    ram = host.meminfo(paths.meminfo).get("MemTotal", 0) / 2**30
    try:
        gpu = host.selected_gpu(host.query_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    except OSError:
        gpu = None
    base = cm.PRESETS["pcie4-4090-7950x"]
    rig = replace(base, name="this host", cores=threads + 1, isa=isa, dram_gbs=dram, ram_gib=ram, cpu_expert_s=per_expert,
                  cpu_job_s=per_job[min(per_job)],
                  sources={**base.sources, "cpu_expert_s": f"timed here: the int16 kernel on {threads} threads, jobs of 1 and 8",
                           "cpu_job_s": "timed here", "dram_gbs": "measured here"})
    if gpu is None:
        return replace(rig, sources={**rig.sources, "link_gbs": "no GPU found: the preset's PCIe 4 x16 (give --link-gbs)"})
    link = cm.pcie_link_gbs(gpu.pcie_gen, gpu.pcie_width)
    return cm.described(rig, name="this host", gpu=gpu.name, vram_gb=min(gpu.total / 1e9, 24.0), link_gbs=link)


# ---- the table


def settings_for(projection: cm.Projection, rig: cm.Rig, mode: str) -> str:
    slots = projection.slots_per_layer * cm.GLM53_FLASH.moe_layers
    line = f"GLM53_MODE={mode} GLM53_EC_CACHE_EXPERTS={slots}"
    if mode == "fast":
        threads = max(1, rig.cores - 1)
        line += f" GLM53_CT_ENABLE=auto (the tier: {threads} thread{'s' if threads > 1 else ''})"
    return line


def needed_cpu_speedup(rig: cm.Rig, profile: np.ndarray, target_tok_s: float) -> float | None:
    """How many times faster the CPU tier's figures must be for fast mode to decode ``target_tok_s`` at one stream
    (None: not within 100x: the link or the GPU bounds it)."""
    lo, hi = 1.0, 100.0
    if cm.project(rig, profile, streams=(1,)).decode_tok_s["fast"][1] >= target_tok_s:
        return 1.0
    scaled = lambda f: replace(rig, cpu_expert_s={t: v / f for t, v in rig.cpu_expert_s.items()}, cpu_job_s=rig.cpu_job_s / f)  # noqa: E731
    if cm.project(scaled(hi), profile, streams=(1,)).decode_tok_s["fast"][1] < target_tok_s:
        return None
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if cm.project(scaled(mid), profile, streams=(1,)).decode_tok_s["fast"][1] < target_tok_s else (lo, mid)
    return hi


def report(rig: cm.Rig, profile: np.ndarray) -> dict:
    """The projection and its context, as ``--json`` prints it."""
    p = cm.project(rig, profile)
    band = cm.error_band()
    pick = "fast" if p.decode_tok_s["fast"][1] > 1.02 * p.decode_tok_s["exact"][1] else "exact"
    out = {"rig": {k: v for k, v in asdict(rig).items() if k not in ("sources", "published")}, "sources": dict(rig.sources),
           "projection": asdict(p), "pick": pick, "settings": {m: settings_for(p, rig, m) for m in ("exact", "fast")},
           "fits_in_ram": {m: p.host_ram_gib[m] <= rig.ram_gib for m in ("exact", "fast")}, "error_band": band,
           "published": dict(rig.published)}
    if rig.published.get("fast_tok_s"):
        target = 1.1 * rig.published["fast_tok_s"]
        speedup = needed_cpu_speedup(rig, profile, target)
        out["to_1_1x_published_fast"] = {"target_tok_s": round(target, 2), "cpu_tier_speedup_needed": speedup,
                                         "cpu_expert_us_needed": None if speedup is None else round(1e6 * rig.cpu_expert_s[1] / speedup, 1),
                                         "dram_share_needed": None if speedup is None else round(
                                             cm.GLM53_FLASH.expert_bytes / (rig.cpu_expert_s[1] / speedup) / 1e9 / rig.dram_gbs, 2)}
    return out


def _tier_line(mode: str, tier: dict) -> str:
    """What the RAM tier holds in ``mode`` (its own figures in ``project``'s ``ram_tier``) and the disk reads left."""
    if tier["ram_slots_per_layer"] is None:
        return f"{mode} mode holds every expert"
    disk = tier["disk_misses_per_layer"]
    return (f"{mode} mode holds {tier['ram_slots_per_layer']:.1f} experts a layer beyond the VRAM's ({tier['ram_share']:.1%} of "
            f"them in VRAM or RAM), and {disk[1]:.2f} a layer at one stream, {disk[4]:.2f} at four, are read from disk")


def format_report(r: dict) -> str:
    p, rig = r["projection"], r["rig"]
    band = r["error_band"]
    pm = f" ± {100 * band['p90_abs_error']:.0f} % (bench.predict: {band['within_10pct']} of {band['arms']} recorded arms within 10 %)" \
        if band else " (no error band: bench.predict has not been run)"
    lines = [f"glm53 plan: {rig['name']}", f"  {cm.GLM53_FLASH.name}, {p['slots_per_layer']} of {cm.GLM53_FLASH.experts} experts a layer "
             f"in VRAM ({rig['vram_gb']:g} GB card; hit rate {p['hit_rate']:.1%} by the routing profile, hot-first)",
             f"  projected{pm}; not measured", "",
             "| mode | decode 1 stream | decode 4 streams | prefill 8k | host RAM | settings |", "|---|---|---|---|---|---|"]
    for mode in ("exact", "fast"):
        d = p["decode_tok_s"][mode]
        fits = "" if r["fits_in_ram"][mode] else f" (this rig has {rig['ram_gib']:.0f}: a RAM tier)"
        lines.append(f"| {mode}{' (picked)' if r['pick'] == mode else ''} | {d[1]:.1f} tok/s | {d[4]:.1f} tok/s | "
                     f"{p['prefill_tok_s'][mode]:.0f} tok/s | {p['host_ram_gib'][mode]:.1f} GiB{fits} | {r['settings'][mode]} |")
    tier = p["ram_tier"]
    if tier:
        lines += ["", f"  RAM tier: {rig['ram_gib']:.0f} GiB of host RAM; "
                      + "; ".join(_tier_line(mode, held) for mode, held in (("exact", tier), ("fast", tier["fast"])))
                      + f"; read from disk at {tier['disk_gbs']:g} GB/s (and by prefill, every expert neither holds, once a staged "
                      "forward, behind its compute, and in exact mode once more for the prompt's last page, a forward too small "
                      "to stage); fast mode's CPU tier computes its share of the misses where the RAM tier holds them or "
                      "read them, and its copies leave the RAM tier less room"]
    k = p["cpu_experts_per_layer"]
    lines += ["", f"  fast mode sends the CPU tier {k[1]:.1f} experts a layer at one stream, {k[4]:.1f} at four",
              f"  bound, exact: {p['bound']['exact']}", f"  bound, fast: {p['bound']['fast']}"]
    pub = r["published"]
    if pub:
        lines.append("  published on this rig (the original project): " + ", ".join(f"{k} {v:g}" for k, v in pub.items()))
    need = r.get("to_1_1x_published_fast")
    if need:
        if need["cpu_tier_speedup_needed"] is None:
            lines.append(f"  {need['target_tok_s']} tok/s (1.1x its fast mode) is out of reach of the CPU tier alone: the link and the GPU bound it")
        elif need["cpu_tier_speedup_needed"] > 1:
            lines.append(f"  {need['target_tok_s']} tok/s (1.1x its fast mode) needs the CPU tier {need['cpu_tier_speedup_needed']:.2f}x faster: "
                         f"{need['cpu_expert_us_needed']} us an expert at one token (now {1e6 * rig['cpu_expert_s'][1]:.0f}), "
                         f"{need['dram_share_needed']:.0%} of this rig's DRAM read rate")
    lines += ["", "  figures:"] + [f"    {k}: {v}" for k, v in sorted(r["sources"].items())]
    return "\n".join(lines)


def add_parser(sub) -> None:
    ap = sub.add_parser("plan", help="project the full model's decode, prefill and RAM on this host or a described rig",
                        description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(cm.PRESETS), help="a named rig (default: this host, measured)")
    ap.add_argument("--gpu", help="the GPU's name (its memory bandwidth from a table of known GPUs)")
    ap.add_argument("--vram-gb", type=float, help="the card's memory in GB")
    ap.add_argument("--link-gbs", type=float, help="the host link's rate for zero-copy reads and copies (25: PCIe 4 x16)")
    ap.add_argument("--cores", type=int, help="physical CPU cores")
    ap.add_argument("--isa", choices=sorted(cm.CORE_GBS), help="the CPU's widest vector extension the tier's kernel uses")
    ap.add_argument("--dram-gbs", type=float, help="host DRAM read rate")
    ap.add_argument("--ram-gib", type=float, help="host RAM")
    ap.add_argument("--disk-gbs", type=float, help="the checkpoint drive's read rate on expert-sized O_DIRECT reads (bench/disk_bw.py)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run(ns: argparse.Namespace) -> int:
    profile = cm.load_profile(cm.PROFILE)
    given = {k: getattr(ns, k) for k in ("gpu", "vram_gb", "link_gbs", "cores", "isa", "dram_gbs", "ram_gib", "disk_gbs") if getattr(ns, k) is not None}
    if ns.preset:
        rig = cm.PRESETS[ns.preset]
        rig = cm.described(rig, **given) if given else rig
    elif given and {"link_gbs", "cores", "isa"} <= set(given):
        rig = cm.described(cm.PRESETS["pcie4-4090-7950x"], name="the rig described", **given)
    else:
        rig = local_rig()
        rig = cm.described(rig, name="this host, with the figures given", **given) if given else rig
    r = report(rig, profile)
    print(json.dumps(r, indent=1, default=str) if ns.json else format_report(r))
    return 0
