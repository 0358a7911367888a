"""One cost model of the offloaded engine: what a decode step and a prefill take, from component figures measured on
the running machine (or given for another rig), and what host RAM a mode needs. Every figure the project predicts
comes from here: the CPU tier's split (:class:`Costs`, per MoE layer, the table the device's split kernel reads),
``glm53 plan`` and preflight (a rig's projection), and the benchmarks' bounds and ``bench.predict`` (which replays it
against every recorded run and gives its error band).

Per MoE layer of a decode step with T tokens (``hits`` experts resident in VRAM, ``misses`` read over the link,
``k`` of those computed on the CPU tier instead; where host RAM holds a RAM tier rather than every expert,
``disk_misses`` of the misses are read from disk into RAM first, each adding ``disk_expert_s``)::

    gpu(k) = gpu_fixed_s + hits * vram_expert_s + (misses - k) * link_expert_s
    cpu(k) = 0 if k == 0 else handoff_s + cpu_job_s[T] + k * cpu_expert_s[T]
    k*     = argmin_k max(gpu(k), cpu(k))       (ties: the fewest on the CPU)

A step is its fixed part (everything but the misses' reads: the non-MoE layers, each MoE layer's fixed part and its
hits; what the same step takes with every expert in VRAM) plus, per MoE layer, what its misses add: ``misses *
link_expert_s`` in exact mode, ``max(gpu(k*), cpu(k*)) - gpu(0 misses)`` and the tier's hooks in fast mode. How many
experts a layer misses at a VRAM share follows from the routing profile (:func:`distinct_misses`). A prefill streams
each layer's missing experts over the link once per forward, overlapped with the layer before (staging), so a layer
takes the longer of its compute and its copy.

Standard library and NumPy only: the CPU tier, preflight and the benches all import it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

TOKENS = (1, 2, 4, 8)  # token counts the CPU cost is measured at (others: the next one up)
MAX_TOKENS = 8  # decode rows a step's split takes (exllamav3's fused decode tier)


@dataclass(frozen=True)
class Costs:
    """Seconds per expert on each path, and the fixed cost of one CPU job."""

    cpu_expert_s: Mapping[int, float]  # tokens -> each expert of a job on the CPU tier (the worker's pool)
    handoff_s: float  # publish, the worker's poll, the GPU's poll and the fp32 add
    link_expert_s: float  # a non-resident expert read by the GPU over the link
    vram_expert_s: float  # a resident expert
    sources: Mapping[str, str] = field(default_factory=dict)  # how each figure was obtained (for /stats)
    cpu_job_s: Mapping[int, float] = field(default_factory=dict)  # tokens -> a job's CPU time beyond its experts' (none: 0)
    cpu_pinned: bool = False  # the CPU figures are given (GLM53_CT_B, a check), so live timings do not move them
    gpu_fixed_s: float = 0.0  # the GPU's time for its part of a layer beyond its experts' (live, fit_gpu_line)
    forced: bool = False  # a check's costs (every_miss_to_the_cpu): the split must run, whatever it saves
    disk_expert_s: float = 0.0  # a miss in the RAM tier too: read from disk into a RAM slot before the link reads it
    # a decode layer's host work beside a RAM tier that its reads do not hide (the engine synchronises at the layer's
    # routing, so the GPU waits it out): TIER_LAYER_S where projected
    tier_layer_s: float = 0.0

    def __post_init__(self):
        for name in ("handoff_s", "link_expert_s", "vram_expert_s", "gpu_fixed_s", "disk_expert_s", "tier_layer_s"):
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0 seconds, not {value!r}")
        if not self.cpu_expert_s or any(not (v > 0 and np.isfinite(v)) or t < 1 for t, v in self.cpu_expert_s.items()):
            raise ValueError(f"cpu_expert_s must map token counts >= 1 to seconds > 0, not {dict(self.cpu_expert_s)!r}")
        if any(not (v >= 0 and np.isfinite(v)) or t < 1 for t, v in self.cpu_job_s.items()):
            raise ValueError(f"cpu_job_s must map token counts >= 1 to seconds >= 0, not {dict(self.cpu_job_s)!r}")

    def cpu_per_expert(self, tokens: int) -> float:
        """The measured time at the smallest measured token count >= tokens (beyond them: scaled from the largest)."""
        t = _measured_at(self.cpu_expert_s, tokens)
        return self.cpu_expert_s[t] * (max(tokens, t) / t)

    def cpu_per_job(self, tokens: int) -> float:
        """A job's CPU time beyond its experts', at the smallest measured token count >= tokens (0 if none)."""
        return self.cpu_job_s[_measured_at(self.cpu_job_s, tokens)] if self.cpu_job_s else 0.0

    def gpu_seconds(self, hits: int, misses: int) -> float:
        return self.gpu_fixed_s + hits * self.vram_expert_s + misses * self.link_expert_s

    def cpu_seconds(self, k: int, tokens: int) -> float:
        return 0.0 if k == 0 else self.handoff_s + self.cpu_per_job(tokens) + k * self.cpu_per_expert(tokens)

    def table(self, max_tokens: int, max_experts: int) -> np.ndarray:
        """``k*`` for every (tokens, hits, misses) with tokens in 1..max_tokens and hits + misses <= max_experts, as
        uint8 ``[max_tokens + 1, max_experts + 1, max_experts + 1]`` (index 0 of tokens unused; impossible cells
        0): what the device's split kernel looks up. Every cell is the ``k`` that minimises
        ``max(gpu_seconds(hits, misses - k), cpu_seconds(k, tokens))`` (the first minimum: ties go to the fewest on
        the CPU; ``tests/cpu_tier/test_split.py`` checks it against trying every ``k``), computed in closed form
        because the live refresh rebuilds it every few steps: for k >= 1 the GPU's time falls and the CPU's rises
        linearly in k, so the best k >= 1 is one of the two integers around where they cross, and it is taken over
        k = 0 only when strictly cheaper."""
        if not 1 <= max_tokens <= MAX_TOKENS or not 1 <= max_experts <= 255:
            raise ValueError(f"max_tokens must be in 1..{MAX_TOKENS} and max_experts in 1..255")
        out = np.zeros((max_tokens + 1, max_experts + 1, max_experts + 1), np.uint8)
        n = np.arange(max_experts + 1, dtype=np.float64)
        hits, misses = n[:, None], n[None, :]  # axes: hits, misses
        possible = (hits + misses <= max_experts) & (misses >= 1)
        gpu0 = self.gpu_fixed_s + hits * self.vram_expert_s  # the GPU's time beyond its misses
        for tokens in range(1, max_tokens + 1):
            job, per = self.handoff_s + self.cpu_per_job(tokens), self.cpu_per_expert(tokens)
            cross = (gpu0 + misses * self.link_expert_s - job) / (self.link_expert_s + per)  # where gpu(k) = cpu(k)
            lo = np.clip(np.floor(cross), 1, np.maximum(misses, 1))
            hi = np.clip(lo + 1, 1, np.maximum(misses, 1))

            def cost(k):
                return np.maximum(gpu0 + (misses - k) * self.link_expert_s, job + k * per)

            best = np.where(cost(hi) < cost(lo), hi, lo)
            none = gpu0 + (misses - 0) * self.link_expert_s
            out[tokens] = np.where(possible & (cost(best) < none), best, 0).astype(np.uint8)
        return out

    def table_drift(self, other: Costs, tokens: int) -> float:
        """How far the figures the table is built from moved from ``other``'s, as the largest change over the
        per-expert and per-job CPU times (token counts 1..``tokens``), the link's, the VRAM's, the handoff and the
        GPU's fixed part, relative to the larger of the two and a 5 us floor (so that a near-zero figure's jitter
        does not count): a refresh rebuilds the table only past a small drift."""
        def figures(c: Costs) -> np.ndarray:
            return np.array([*(c.cpu_per_expert(t) for t in range(1, tokens + 1)), *(c.cpu_per_job(t) for t in range(1, tokens + 1)),
                             c.link_expert_s, c.vram_expert_s, c.handoff_s, c.gpu_fixed_s])
        a, b = figures(self), figures(other)
        return float((np.abs(a - b) / np.maximum(np.maximum(a, b), 5e-6)).max())

    def savings(self, tokens: np.ndarray, hits: np.ndarray, misses: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Seconds the split saves each layer (arrays alike) by sending ``k`` of its ``misses`` to the CPU: the GPU's
        time for all of them less the slower of the two paths (0 where ``k`` is 0)."""
        tokens, hits, misses, k = (np.asarray(a, dtype=np.int64) for a in (tokens, hits, misses, k))
        per_expert = np.array([0.0] + [self.cpu_per_expert(t) for t in range(1, int(tokens.max(initial=1)) + 1)])
        per_job = np.array([0.0] + [self.cpu_per_job(t) for t in range(1, int(tokens.max(initial=1)) + 1)])
        gpu0 = self.gpu_fixed_s + hits * self.vram_expert_s
        none = gpu0 + misses * self.link_expert_s
        split = np.maximum(gpu0 + (misses - k) * self.link_expert_s,
                           self.handoff_s + per_job[tokens] + k * per_expert[tokens])
        return np.where(k > 0, none - split, 0.0)

    JUMP = 1.5  # a live CPU figure this much higher than the model replaces it instead of being averaged in
    EASE = 1.25  # a lower live figure lowers the model by at most this factor a refresh (slow to trust a free host)

    def refreshed(self, busy_s: float, experts: int, tokens: int, jobs: int = 0, weight: float = 0.5,
                  ease: float | None = None) -> Costs:
        """Every CPU figure (per job and per expert, at every token count) scaled by a live measurement: the worker's
        busy time since the last refresh over what the model predicts for its ``jobs`` jobs (of about ``tokens``
        tokens) and the ``experts`` they computed. The ratio is averaged in by ``weight``, taken outright when it is
        more than ``JUMP`` (other processes took the host's cores or memory bus), and lowers the model by at most
        ``EASE`` a refresh (a host that seems free again is trusted step by step: a wrong guess costs late jobs;
        ``ease`` overrides that factor, ``weight=1, ease=inf`` gives the live ratio outright). A busy host is slower
        at every size, and the fixed and per-expert parts move together: figures raised by late jobs (:meth:`slower`)
        come back down the same way, whatever part they were raised in. Pinned figures (``cpu_pinned``) stay."""
        if experts <= 0 or busy_s <= 0 or self.cpu_pinned:
            return self
        live = busy_s / (jobs * self.cpu_per_job(tokens) + experts * self.cpu_per_expert(tokens))
        factor = live if live > self.JUMP else max((1 - weight) + weight * live, 1 / (ease or self.EASE))
        return self._scaled(factor, "measured at start, refreshed from the worker")

    def slower(self, factor: float) -> Costs:
        """Every CPU figure (per expert and per job) times ``factor``: jobs came late, whatever the busy time said.
        Pinned figures stay."""
        return self if self.cpu_pinned else self._scaled(factor, "raised: jobs came late")

    def _scaled(self, factor: float, source: str) -> Costs:
        return replace(self, cpu_expert_s={t: v * factor for t, v in self.cpu_expert_s.items()},
                       cpu_job_s={t: v * factor for t, v in self.cpu_job_s.items()}, sources={**self.sources, "cpu_expert_s": source})

    def starved(self, max_misses: int = 64) -> Costs:
        """Costs under which the split sends the CPU nothing (its jobs were not even claimed in time): every CPU
        figure times the smallest factor that makes a one-expert job cost more than the GPU's time for
        ``max_misses`` misses (their ratios across token counts kept, and the factor no larger than needed, so that
        shadow jobs bring the host back within a few refreshes once it is free). Pinned figures stay."""
        if self.cpu_pinned:
            return self
        gpu = self.gpu_fixed_s + max_misses * self.link_expert_s
        # handoff + factor * (job + expert) just over the GPU's time, at every measured token count
        factor = max(1.0, max((1.001 * gpu - self.handoff_s) / (self.cpu_per_job(t) + self.cpu_per_expert(t)) for t in self.cpu_expert_s))
        return self._scaled(factor, "starved: jobs not claimed in time")

    def with_gpu_line(self, fixed_s: float, per_miss_s: float) -> Costs:
        """The GPU's figures from a live line (:func:`fit_gpu_line`): ``per_miss_s`` becomes the link's cost of an
        expert, ``fixed_s`` the rest of the GPU's part of a layer."""
        return replace(self, link_expert_s=per_miss_s, gpu_fixed_s=fixed_s,
                       sources={**self.sources, "link_expert_s": f"live: {per_miss_s * 1e6:.0f} us a zero-copy miss + "
                                                                 f"{fixed_s * 1e6:.0f} us a layer, on the GPU's clock"})


def _measured_at(figures: Mapping[int, float], tokens: int) -> int:
    """The smallest measured token count >= ``tokens``, else the largest measured."""
    return min((t for t in figures if t >= tokens), default=max(figures))


# ---- routing: how many experts a layer misses at a VRAM share

PROFILE = Path(__file__).resolve().parent / "models" / "glm53-flash-routing-profile.json"  # the real model's, package data


def load_profile(path: Path) -> np.ndarray:
    """float [layers, experts] picks per expert from a routing profile (``{layer key: [count per expert]}``, in the
    file's order: ``glm53/models/glm53-flash-routing-profile.json``, a checkpoint's ``routing-stats.json``)."""
    data = json.loads(Path(path).read_text())
    return np.array([np.asarray(v, dtype=np.float64) for v in data.values()])


def pick_probabilities(profile: np.ndarray, top_k: int) -> np.ndarray:
    """Per layer and expert, the chance that one token picks it (``top_k`` picks a token, spread as the profile's)."""
    shares = profile / profile.sum(axis=1, keepdims=True)
    return np.minimum(1.0, top_k * shares)


def hot_first(profile: np.ndarray, slots_per_layer: int) -> np.ndarray:
    """bool [layers, experts]: resident when among a layer's ``slots_per_layer`` most picked (the cache's warm start)."""
    order = np.argsort(-profile, axis=1, kind="stable")
    resident = np.zeros(profile.shape, dtype=bool)
    np.put_along_axis(resident, order[:, : max(0, slots_per_layer)], True, axis=1)
    return resident


def hit_rate(profile: np.ndarray, slots_per_layer: int) -> float:
    """Share of picks a hot-first placement of ``slots_per_layer`` experts a layer serves from VRAM."""
    resident = hot_first(profile, slots_per_layer)
    return float((profile * resident).sum() / profile.sum())


def distinct_misses(profile: np.ndarray, slots_per_layer: int, top_k: int, tokens: int) -> tuple[float, float]:
    """(missed, resident) distinct experts a MoE layer's step of ``tokens`` independent tokens touches, on average over
    the layers: sum over experts of 1 - (1 - p)^tokens, p a token's chance of picking it."""
    p = pick_probabilities(profile, top_k)
    touched = 1.0 - (1.0 - p) ** tokens
    resident = hot_first(profile, slots_per_layer)
    return float((touched * ~resident).sum(axis=1).mean()), float((touched * resident).sum(axis=1).mean())


# ---- a decode step and a prefill


@dataclass(frozen=True)
class Step:
    """A decode step's shape: ``fixed_s`` everything but the misses' reads (the all-VRAM step: non-MoE layers, each MoE
    layer's fixed part and its hits), ``misses`` and ``hits`` distinct experts a MoE layer reads from host and VRAM,
    ``disk_misses`` of those misses not in host RAM either (a RAM tier's misses)."""

    fixed_s: float
    moe_layers: int
    misses: float
    hits: float
    tokens: int = 1
    disk_misses: float = 0.0
    tiered: bool = False  # beside a RAM tier (its host work a layer: ``Costs.tier_layer_s``)


def disk_s(step: Step, costs: Costs) -> float:
    """A step's RAM tier: its misses, each read from disk into a RAM slot before the link reads it (not overlapped
    with the GPU's work: what reading them a layer ahead would win is not counted), and its host work a layer."""
    return step.moe_layers * (step.disk_misses * costs.disk_expert_s + (costs.tier_layer_s if step.tiered else 0.0))


def exact_step_s(step: Step, costs: Costs) -> float:
    """Exact mode: every miss read over the link by the GPU, the RAM tier's misses from disk first."""
    return step.fixed_s + step.moe_layers * step.misses * costs.link_expert_s + disk_s(step, costs)


def split_k(costs: Costs, tokens: int, hits: int, misses: int) -> int:
    """The split's ``k*`` (the closed form of :meth:`Costs.table`, one cell)."""
    tokens = min(max(tokens, 1), MAX_TOKENS)
    table = costs.table(tokens, max(1, min(255, hits + misses)))
    return int(table[tokens, hits, misses]) if misses else 0


def fast_step_s(step: Step, costs: Costs, hook_s: float = 0.0) -> tuple[float, float]:
    """Fast mode: (step seconds, experts a layer sends the CPU). Each MoE layer takes the longer of the GPU's part and
    the CPU's job at the split's ``k*``, plus ``hook_s`` (the tier's hooks on the GPU's clock) where it sends any;
    fractional miss counts are interpolated between the two integers around them."""
    lo = math.floor(step.misses)
    frac = step.misses - lo
    hits = int(round(step.hits))

    def layer(m: int) -> tuple[float, int]:
        k = split_k(costs, step.tokens, hits, m)
        base = costs.gpu_seconds(hits, 0)
        took = max(costs.gpu_seconds(hits, m - k), costs.cpu_seconds(k, step.tokens)) - base
        return took + (hook_s if k else 0.0), k

    (t0, k0), (t1, k1) = layer(lo), layer(lo + 1)
    per_layer = (1 - frac) * t0 + frac * t1
    return step.fixed_s + step.moe_layers * per_layer + disk_s(step, costs), (1 - frac) * k0 + frac * k1


def more_layers_s(t_allvram_s: float, t_arm_s: float, layers: int, to_layers: int, dense_layers: int) -> float:
    """A step (or a prompt) measured on ``layers`` MoE layers, at ``to_layers``: the all-VRAM part grows with every
    layer (``dense_layers`` of them before the MoE ones), and what the arm adds to it is per MoE layer (its misses,
    staging, the CPU tier's share). ``bench.extrapolate``'s model; an arm with nothing beyond all-VRAM passes
    ``t_arm_s == t_allvram_s``."""
    grow = (dense_layers + to_layers) / (dense_layers + layers)
    return t_allvram_s * grow + to_layers * (t_arm_s - t_allvram_s) / layers


def prefill_s(tokens: int, moe_layers: int, compute_s_per_token: float, stream_bytes_per_layer: float, copy_gbs: float,
              chunk: int = 8192, last_page_split: bool = False, zero_copy_gbs: float | None = None) -> float:
    """A prompt of ``tokens``: each chunk's MoE layers take the longer of their share of the compute and their experts'
    copy (``stream_bytes_per_layer``, the non-resident experts, staged one layer ahead); with ``last_page_split``
    (exact mode, as stock) the last page is a forward of its own too small to stage, which reads those experts once
    more zero-copy."""
    chunks = max(1, math.ceil(tokens / chunk))
    compute = tokens * compute_s_per_token
    stream = moe_layers * stream_bytes_per_layer / (copy_gbs * 1e9)
    total = compute + max(0.0, chunks * stream - compute)  # the copies hide behind the compute, or it behind them
    if last_page_split:
        total += moe_layers * stream_bytes_per_layer / ((zero_copy_gbs or copy_gbs) * 1e9)
    return total


# ---- host RAM

STORE_PADDING = 1.02  # the host store's alignment padding, at most
# A decode layer's host work beside a RAM tier that its disk reads do not hide: the rest of the tier's step after the
# reads (0.42-0.46 ms a layer on the H200 host, 2026-12-04, bench/results/2026-12-04-offload-session6-h200.md); the
# policy's step and the tables' re-pointing run while the reads are in flight. There the model without it gave 134.5
# ms a token at half the experts against 141.2 measured (12 MoE layers: 0.56 ms a layer unexplained).
TIER_LAYER_S = 0.45e-3
PROCESS_OVERHEAD = 6 * 2**30  # the rest of the process: Python, torch and CUDA's host allocations, the tokenizer, buffers
CPU_TIER_PER_THREAD = 64 * 2**20  # a CPU-tier thread's stack and working buffers (a planning figure)


def host_ram_needed(routed_bytes: int, sign_scale_bytes: int, mode: str, tier_threads: int) -> int:
    """Host RAM a mode needs: every routed expert once (padded), the process, and in fast mode the CPU tier's copies
    of the experts' sign/scale vectors and its threads' buffers (the expert store itself is not copied)."""
    need = int(STORE_PADDING * routed_bytes) + PROCESS_OVERHEAD
    if mode == "fast":
        need += sign_scale_bytes + CPU_TIER_PER_THREAD * tier_threads
    return need


def expert_ram_budget(available_bytes: int, sign_scale_bytes: int, mode: str, tier_threads: int) -> int:
    """Host bytes left for routed experts (``GLM53_HOST_RAM_GB`` unset): what is available less what the rest of the
    process needs (:func:`host_ram_needed` without the store)."""
    return max(0, available_bytes - host_ram_needed(0, sign_scale_bytes, mode, tier_threads))


# ---- a rig and the full-size model, for projections


@dataclass(frozen=True)
class ModelFacts:
    """What a projection needs of the model."""

    name: str
    moe_layers: int
    dense_layers: int
    experts: int
    top_k: int
    expert_bytes: float
    vram_other_gb: float  # VRAM for all but the routed experts: the other weights, KV and recurrent caches, activations
    sign_scale_bytes: int

    @property
    def routed_bytes(self) -> int:
        return int(self.moe_layers * self.experts * self.expert_bytes)


# GLM-5.3-Flash, EXL3 3.05 bpw (DESIGN.md): 42 MoE layers x 288 experts x 9.44 MB. Its other weights, a 131k-token KV
# cache, four recurrent-state slots and the activations took 8-9 GB of the original project's RTX 3090, whose expert
# cache then held 13.0 GB (1,376 slots, 32.8 a layer) beside a 1.5 GB reserve (shared/notes/anchor.md 4.5)
GLM53_FLASH = ModelFacts("GLM-5.3-Flash EXL3 3.05 bpw", moe_layers=42, dense_layers=3, experts=288, top_k=8, expert_bytes=9.44e6,
                         vram_other_gb=9.5, sign_scale_bytes=int(0.45e9))
VRAM_RESERVE_GB = 1.5  # fast mode's GLM53_EC_RESERVE_GB


@dataclass(frozen=True)
class Rig:
    """A machine's component figures (``sources`` says where each comes from: measured here, published, or assumed)."""

    name: str
    gpu: str
    vram_gb: float
    hbm_gbs: float
    link_gbs: float  # zero-copy reads of host memory (a miss)
    copy_gbs: float  # copy-engine copies (prefill staging)
    cores: int  # physical cores the CPU tier may use (one is left to the thread feeding the GPU)
    isa: str
    dram_gbs: float
    ram_gib: float
    cpu_expert_s: Mapping[int, float]  # the CPU tier's time per expert of a batch, by tokens
    cpu_job_s: float  # a job's fixed part (a one-expert job spreads worse over the threads than a batch)
    handoff_s: float
    layer_fixed_s: float  # a MoE layer's GPU time beyond its experts' reads (routing, shared expert, launches)
    other_layer_s: float  # every layer's GPU time outside its routed experts (attention, norms, dense MLPs), per token
    prefill_s_per_token: float  # the GPU's prefill compute per token of the full model, every expert in VRAM
    sources: Mapping[str, str] = field(default_factory=dict)
    disk_gbs: float = 7.0  # the checkpoint's drive, O_DIRECT reads of expert size (the RAM tier's misses)
    published: Mapping[str, float] = field(default_factory=dict)  # the rig's published figures, shown beside the projection

    def costs(self, model: ModelFacts = GLM53_FLASH) -> Costs:
        B = model.expert_bytes
        return Costs(cpu_expert_s=dict(self.cpu_expert_s), handoff_s=self.handoff_s, link_expert_s=B / (self.link_gbs * 1e9),
                     vram_expert_s=B / (self.hbm_gbs * 1e9), cpu_job_s={t: self.cpu_job_s for t in self.cpu_expert_s},
                     gpu_fixed_s=self.layer_fixed_s, sources=dict(self.sources), disk_expert_s=B / (self.disk_gbs * 1e9),
                     tier_layer_s=TIER_LAYER_S)

    def cache_slots_per_layer(self, model: ModelFacts = GLM53_FLASH) -> int:
        """Experts a layer keeps in VRAM: what the card holds beyond the other weights and the reserve."""
        free = (self.vram_gb - model.vram_other_gb - VRAM_RESERVE_GB) * 1e9
        return max(0, min(model.experts, int(free / model.expert_bytes / model.moe_layers)))

    def ram_tier_slots_per_layer(self, model: ModelFacts = GLM53_FLASH, mode: str = "exact") -> float | None:
        """Experts a layer keeps in host RAM beyond the VRAM's when RAM cannot hold them all (None: it holds them all,
        no RAM tier): the RAM left after the process (``mode``'s needs: in fast mode the CPU tier's copies and
        threads too) less the tier's window of one layer's experts (``offload.ram_tier.plan``), in padded blocks."""
        budget = expert_ram_budget(int(self.ram_gib * 2**30), model.sign_scale_bytes, mode, max(1, self.cores - 1))
        if budget >= STORE_PADDING * model.routed_bytes:
            return None
        blocks = budget / (STORE_PADDING * model.expert_bytes) - model.experts
        return max(0.0, blocks / model.moe_layers)


# ---- a described rig's figures from its parts

# the kernel's measured rate a core (GB/s of expert bytes, int16 codebook, experts cycled from DRAM), by ISA and tokens:
# Zen 4 on the development machine (bench/results/2026-12-01-fifth-session-cpu-kernel-int16.md); an ISA not listed runs
# the scalar kernel, which the tier does not use
CORE_GBS = {"avx512vbmi": {1: 5.1, 4: 3.4}, "avx512": {1: 2.9, 4: 2.1}, "avx2": {1: 2.7, 4: 1.8}}
SCALING = 0.8  # a batch's rate on many cores over the sum of one core's (0.8 on the H200 host's 16 CPUs)
DRAM_SHARE = 0.8  # the most of the DRAM read rate the tier's reads are counted to take
# PCIe: zero-copy reads of host memory measured at 50.8 GB/s on a gen 5 x16 link (3.2 GB/s a lane); older generations
# halve it each
LANE_GBS = {3: 0.8, 4: 1.6, 5: 3.2, 6: 6.4}
HBM = {"H200": 4800, "H100": 3350, "A100": 1935, "RTX 5090": 1792, "RTX 4090": 1008, "RTX 3090": 936, "RTX A6000": 768,
           "L40S": 864, "RTX 4080": 717, "RTX 3080": 760}




def pcie_link_gbs(gen: int | None, width: int | None) -> float | None:
    """The zero-copy read rate a PCIe link of this generation and width gives (None when either is not known)."""
    return LANE_GBS.get(gen, LANE_GBS[4]) * width if gen and width else None


def hbm_gbs(gpu: str) -> float | None:
    """A known GPU's memory bandwidth by its name (``nvidia-smi``'s or a user's), else None."""
    return next((v for k, v in HBM.items() if k.lower() in gpu.lower()), None)


def cpu_expert_s_from_rates(isa: str, cores: int, dram_gbs: float) -> dict[int, float]:
    """The CPU tier's time per expert of a batch on ``cores`` cores (one left to the thread feeding the GPU).

    :raise ValueError: an ISA the tier has no kernel for."""
    if isa not in CORE_GBS:
        raise ValueError(f"--isa {isa!r} is not accepted: expected one of {', '.join(CORE_GBS)}")
    threads = max(1, cores - 1)
    return {t: GLM53_FLASH.expert_bytes / (min(threads * gbs * SCALING, DRAM_SHARE * dram_gbs) * 1e9) for t, gbs in CORE_GBS[isa].items()}



# The H200 test host's measured figures (bench/results/2026-12-02-*), as the one measured rig the others are set
# against. Its GPU figures stand in for every GPU's where nothing better is known: a decode layer at one token is bound
# by launches and latency more than by the GPU's bandwidth (the RTX 3090 of the original project measured 0.249 ms a
# layer outside the routed experts, this host 0.28).
_H200_GPU = {"layer_fixed_s": 80e-6, "other_layer_s": 0.28e-3, "prefill_s_per_token": 1 / 2560}
_H200_GPU_SOURCES = {
    "layer_fixed_s": "the H200 host's live GPU line: 78-86 us a MoE layer beyond its misses (2026-12-02)",
    "other_layer_s": "the H200 host: the scaled checkpoint's all-VRAM step, 5.26 ms over 15 layers, less its MoE layers' fixed parts",
    "prefill_s_per_token": "the H200 host: stock exllamav3 all in VRAM, 4096-token prompts at 7.1-8.3k tok/s on 15 layers, scaled to 45",
}
DISK_ASSUMED = "assumed: a PCIe 4 NVMe drive's sequential read (7 GB/s); --disk-gbs gives another (bench/disk_bw.py measures one)"
PRESETS: dict[str, Rig] = {
    "h200-test-host": Rig(
        "the H200 test host, a 24 GB card's share (GLM53_VRAM_LIMIT_GB)", gpu="NVIDIA H200 (24 GB share)", vram_gb=24, hbm_gbs=4200,
        link_gbs=50.8, copy_gbs=55.3, cores=16, isa="avx512vbmi", dram_gbs=95, ram_gib=128,
        cpu_expert_s={1: 315e-6, 4: 474e-6}, cpu_job_s=204e-6, handoff_s=20e-6, **_H200_GPU,
        sources={"link_gbs": "bench.bandwidth, 2026-12-02", "cpu_expert_s": "bench/cpu_expert_bw.py, int16, 16 CPUs, 8 experts a call",
                 "cpu_job_s": "one-expert jobs (0.519 ms) less a batch's expert (0.315), 16 CPUs", "handoff_s": "assumed",
                 "disk_gbs": DISK_ASSUMED, **_H200_GPU_SOURCES}),
    "anchor-3090-epyc7443p": Rig(
        "the original project's rig: RTX 3090 on PCIe 4 x16, EPYC 7443P (24 Zen 3 cores, AVX2), 8-channel DDR4",
        gpu="NVIDIA RTX 3090", vram_gb=24, hbm_gbs=936, link_gbs=25.0, copy_gbs=25.0, cores=24, isa="avx2", dram_gbs=138, ram_gib=503,
        # this project's int16 AVX2 kernel at its Zen 4 rate a core (not measured on Zen 3), on 23 threads
        cpu_expert_s=cpu_expert_s_from_rates("avx2", 24, 138), cpu_job_s=204e-6, handoff_s=20e-6,
        layer_fixed_s=_H200_GPU["layer_fixed_s"], other_layer_s=0.249e-3, prefill_s_per_token=1 / 720, disk_gbs=26.0,
        sources={"disk_gbs": "published: its NVMe modes' 4x Samsung 9100 PRO in md RAID0, a ~26 GB/s ceiling","link_gbs": "published: PCIe 4.0 x16, ~25 GB/s host to device", "dram_gbs": "published: 136-140 GB/s measured read",
                 "cpu_expert_s": "this project's AVX2 int16 rate a core on Zen 4 x 23 threads x 0.8 (not measured there)",
                 "cpu_job_s": "the H200 host's (assumed)", "handoff_s": "assumed", "layer_fixed_s": _H200_GPU_SOURCES["layer_fixed_s"],
                 "other_layer_s": "published: 11.2 ms a token of non-MoE GPU work over 45 layers",
                 "prefill_s_per_token": "published: 710 tok/s at 8k, compute-bound (its link would stream 2,000)"},
        published={"exact_tok_s": 12.57, "fast_tok_s": 28.15, "fast_4_streams_tok_s": 33.98, "exact_4_streams_tok_s": 12.64,
                   "stock_cpu_worker_tok_s_low": 7.5, "stock_cpu_worker_tok_s_high": 8.4, "fast_prefill_8k_tok_s": 710,
                   "exact_prefill_8k_tok_s": 697, "nvme_55gib_fast_tok_s": 14.85, "nvme_55gib_exact_tok_s": 8.28}),
    "pcie4-4090-7950x": Rig(
        "a workstation: RTX 4090 on PCIe 4 x16, Ryzen 9 7950X (16 Zen 4 cores, AVX-512 VBMI), 2-channel DDR5, 128 GB",
        gpu="NVIDIA RTX 4090", vram_gb=24, hbm_gbs=1008, link_gbs=25.0, copy_gbs=25.0, cores=16, isa="avx512vbmi", dram_gbs=64, ram_gib=128,
        cpu_expert_s=cpu_expert_s_from_rates("avx512vbmi", 16, 64), cpu_job_s=204e-6,
        handoff_s=20e-6, layer_fixed_s=_H200_GPU["layer_fixed_s"], other_layer_s=0.249e-3, prefill_s_per_token=1 / 900,
        sources={"link_gbs": "PCIe 4.0 x16 (assumed 25 GB/s)", "cpu_expert_s": "this project's int16 VBMI rate a core on Zen 4 (2026-12-01) "
                 "x 15 threads x 0.8, at most 0.8 of DRAM", "other_layer_s": "the RTX 3090's (assumed)",
                 "prefill_s_per_token": "assumed: the RTX 3090's 710 tok/s x 1.25", "disk_gbs": DISK_ASSUMED}),
}


def described(base: Rig, *, name: str | None = None, gpu: str | None = None, vram_gb: float | None = None,
              link_gbs: float | None = None, cores: int | None = None, isa: str | None = None, dram_gbs: float | None = None,
              ram_gib: float | None = None, disk_gbs: float | None = None) -> Rig:
    """``base`` with the given figures replaced; a new CPU, link or DRAM rate re-derives the CPU tier's and the link's
    figures (the GPU's per-layer times stay the base's: assumed)."""
    rig = base
    sources = dict(base.sources)
    if gpu is not None:
        hbm = hbm_gbs(gpu)
        rig = replace(rig, gpu=gpu, hbm_gbs=hbm or rig.hbm_gbs)
        sources["hbm_gbs"] = "the GPU's datasheet" if hbm else f"not known for {gpu!r}: the base rig's"
    if vram_gb is not None:
        rig = replace(rig, vram_gb=vram_gb)
    if link_gbs is not None:
        rig = replace(rig, link_gbs=link_gbs, copy_gbs=link_gbs)
        sources["link_gbs"] = "given"
    if ram_gib is not None:
        rig = replace(rig, ram_gib=ram_gib)
    if disk_gbs is not None:
        rig = replace(rig, disk_gbs=disk_gbs)
        sources["disk_gbs"] = "given"
    if dram_gbs is not None:
        rig = replace(rig, dram_gbs=dram_gbs)
    if cores is not None or isa is not None or dram_gbs is not None:
        rig = replace(rig, cores=cores or rig.cores, isa=isa or rig.isa)
        rig = replace(rig, cpu_expert_s=cpu_expert_s_from_rates(rig.isa, rig.cores, rig.dram_gbs))
        sources["cpu_expert_s"] = (f"the {rig.isa} kernel's measured rate a core x {rig.cores - 1} threads x {SCALING}, at most "
                                   f"{DRAM_SHARE} of DRAM (derived, not measured on this CPU)")
    return replace(rig, name=name or f"{base.name}, with the figures given", sources=sources)


@dataclass(frozen=True)
class Projection:
    """A rig's projected figures for the full model (seconds and rates), and what bounds them."""

    rig: str
    slots_per_layer: int
    hit_rate: float
    decode_tok_s: Mapping[str, Mapping[int, float]]  # mode -> streams -> aggregate tok/s
    cpu_experts_per_layer: Mapping[int, float]  # streams -> experts the split sends the CPU a layer (fast)
    prefill_tok_s: Mapping[str, float]  # mode -> tok/s of an 8k prompt
    host_ram_gib: Mapping[str, float]
    bound: Mapping[str, str]  # mode -> what bounds its one-stream decode
    ram_tier: Mapping[str, object] | None = None  # where RAM cannot hold every expert: its share, disk misses, disk rate


def project(rig: Rig, profile: np.ndarray, model: ModelFacts = GLM53_FLASH, streams: Sequence[int] = (1, 4),
            prompt: int = 8192, hook_s: float = 60e-6) -> Projection:
    """The full model on ``rig``: decode at each stream count and an ``prompt``-token prefill, exact and fast, with the
    routing ``profile``'s popularity at the card's share (hot-first placement; the running cache measured 1.08x
    that hit rate on the scaled checkpoint, so this errs low). ``hook_s``: the tier's hooks on the GPU's clock a
    layer it takes part in (60 us measured on the H200 host)."""
    slots = rig.cache_slots_per_layer(model)
    modes = ("exact", "fast")
    ram_slots = {mode: rig.ram_tier_slots_per_layer(model, mode) for mode in modes}  # None: no RAM tier in that mode
    costs = rig.costs(model)
    disk_misses: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    layers = model.moe_layers + model.dense_layers
    decode: dict[str, dict[int, float]] = {"exact": {}, "fast": {}}
    cpu_k: dict[int, float] = {}
    bound = {}
    for n in streams:
        misses, hits = distinct_misses(profile, slots, model.top_k, n)
        fixed = layers * rig.other_layer_s + model.moe_layers * (rig.layer_fixed_s + hits * costs.vram_expert_s)
        steps = {}
        for mode in modes:
            # hot-first: the RAM tier holds the next-hottest experts after the VRAM's (fractional slots interpolated)
            held = ram_slots[mode]
            disk_misses[mode][n] = 0.0 if held is None else float(np.interp(held % 1, [0, 1], [
                distinct_misses(profile, slots + int(held) + i, model.top_k, n)[0] for i in (0, 1)]))
            steps[mode] = Step(fixed_s=fixed, moe_layers=model.moe_layers, misses=misses, hits=hits, tokens=n,
                               disk_misses=disk_misses[mode][n], tiered=held is not None)
        exact = exact_step_s(steps["exact"], costs)
        # beside a RAM tier the CPU tier computes its share of the misses where the tier holds them (or read them)
        fast, k = fast_step_s(steps["fast"], costs, hook_s)
        fast_as_exact = exact_step_s(steps["fast"], costs)  # its CPU tier resting (GLM53_CT_ENABLE=auto's choice)
        decode["exact"][n], decode["fast"][n] = n / exact, n / min(fast, fast_as_exact)
        cpu_k[n] = k if fast < fast_as_exact else 0.0
        if n == min(streams):
            link = model.moe_layers * misses * costs.link_expert_s
            disk = disk_s(steps["exact"], costs)
            bound["exact"] = (f"the RAM tier: {1e3 * disk:.1f} of {1e3 * exact:.1f} ms a token read its misses at {rig.disk_gbs:g} GB/s "
                              "and do its host work"
                              if disk > link else
                              f"the link: {1e3 * link:.1f} of {1e3 * exact:.1f} ms a token read misses at {rig.link_gbs:g} GB/s")
            gpu_part = max(costs.gpu_seconds(int(round(hits)), max(0, int(round(misses - k)))), 0.0)
            cpu_part = costs.cpu_seconds(int(round(k)), n)
            fast_disk = disk_s(steps["fast"], costs)
            bound["fast"] = (f"the CPU tier: a layer's job ({1e6 * cpu_part:.0f} us for {k:.1f} experts) outlasts the GPU's part "
                             f"({1e6 * gpu_part:.0f} us)" if cpu_part > gpu_part else
                             f"the link: the GPU's part of a layer ({1e6 * gpu_part:.0f} us) outlasts the CPU's job ({1e6 * cpu_part:.0f} us)")
            if fast_disk > model.moe_layers * max(cpu_part, gpu_part):
                bound["fast"] = (f"the RAM tier: {1e3 * fast_disk:.1f} of {1e3 * min(fast, fast_as_exact):.1f} ms a token read its "
                                 f"misses at {rig.disk_gbs:g} GB/s and do its host work (the CPU tier takes {k:.1f} experts a layer)")
    stream_bytes = (model.experts - slots) * model.expert_bytes
    prefill = {mode: prompt / prefill_s(prompt, model.moe_layers, rig.prefill_s_per_token, stream_bytes, rig.copy_gbs,
                                        last_page_split=(mode == "exact"), zero_copy_gbs=rig.link_gbs) for mode in ("exact", "fast")}
    chunks = max(1, math.ceil(prompt / 8192))
    for mode, held in ram_slots.items():
        if held is None:
            continue
        # each prefill forward reads the experts neither VRAM nor the RAM tier holds from disk: a staged one a layer
        # ahead, behind its compute (offload.tier_feed); exact mode's last page, a forward too small to stage, once
        # more at each layer's routing (counted as a whole pass: a page picks nearly every expert)
        disk_pass = model.moe_layers * max(0.0, model.experts - slots - held) * model.expert_bytes / (rig.disk_gbs * 1e9)
        prefill[mode] = prompt / (max(prompt / prefill[mode], chunks * disk_pass) + (disk_pass if mode == "exact" else 0.0))
    ram = {mode: host_ram_needed(model.routed_bytes, model.sign_scale_bytes, mode, max(1, rig.cores - 1)) / 2**30 for mode in modes}
    tier = None
    if any(held is not None for held in ram_slots.values()):
        share = lambda mode: 1.0 if ram_slots[mode] is None else (slots + ram_slots[mode]) / model.experts
        tier = {"ram_share": share("exact"), "ram_slots_per_layer": ram_slots["exact"], "disk_misses_per_layer": disk_misses["exact"],
                "disk_gbs": rig.disk_gbs,
                "fast": {"ram_share": share("fast"), "ram_slots_per_layer": ram_slots["fast"],
                         "disk_misses_per_layer": disk_misses["fast"]}}
    return Projection(rig.name, slots, hit_rate(profile, slots), decode, cpu_k, prefill, ram, bound, tier)


# ---- the model's error, as bench.predict measured it against every recorded run

ERROR_BAND = Path(__file__).with_name("cost_model_error.json")


def error_band() -> dict | None:
    """What ``bench.predict --write-band`` recorded: arms compared, the share within 10 %, the median and 90th
    percentile of |measured / predicted - 1| (None before it ran)."""
    try:
        return json.loads(ERROR_BAND.read_text())
    except (OSError, ValueError):
        return None
