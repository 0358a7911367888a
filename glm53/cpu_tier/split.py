"""The fast mode's split of a decode step's missed experts between the GPU and the CPU tier: a cost model whose
constants are measured on the running machine, and the table the device's split kernel reads.

A MoE layer's decode step with T tokens touches ``hits`` experts resident in VRAM and ``misses`` experts in host
memory. The GPU computes the hits and every miss it keeps (reading it over the link, zero-copy) while the host
worker computes the ``k`` coldest misses; the layer is done when both are:

    gpu(k) = gpu_fixed_s + hits * vram_expert_s + (misses - k) * link_expert_s
    cpu(k) = 0 if k == 0 else handoff_s + cpu_job_s[T] + k * cpu_expert_s[T]
    k*     = argmin_k max(gpu(k), cpu(k))       (ties: the fewest on the CPU)

The constants come from measurements, never from a table in the source: ``cpu_expert_s`` (the time each more
expert adds to a job) and ``cpu_job_s`` (what a job costs beyond that: a one-expert job spreads worse over the
pool's threads than a batch) by timing the expert kernel on the checkpoint's own experts with the pool the worker
uses, in jobs of one expert and of a batch (:func:`measure_cpu`); the link and VRAM figures from the GPU's measured
read rates (``bench/bandwidth.py``'s probes, at start-up); ``handoff_s`` from a round trip through the ring less
the job's own time. Live timings replace them as decode runs: :meth:`Costs.refreshed` folds in the worker's busy
time, and :meth:`Costs.with_gpu_line` the GPU's own time for its part of sampled layers (:func:`fit_gpu_line`:
one more zero-copy miss costs ``link_expert_s``; ``gpu_fixed_s`` is the part that does not grow with the misses,
which the CPU's job can hide behind too). ``GLM53_CT_B`` overrides the per-expert CPU time (ms) outright.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from . import kernel as ce

TOKENS = (1, 2, 4, 8)  # token counts the CPU cost is measured at (others: the next one up)


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

    def __post_init__(self):
        for name in ("handoff_s", "link_expert_s", "vram_expert_s", "gpu_fixed_s"):
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
        if not 1 <= max_tokens <= ce.MAX_ROWS or not 1 <= max_experts <= 255:
            raise ValueError(f"max_tokens must be in 1..{ce.MAX_ROWS} and max_experts in 1..255")
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


GPU_LINE_MIN_SAMPLES = 48  # sampled layers before a line is trusted


def fit_gpu_line(misses, seconds, probe_s: float) -> tuple[float, float] | None:
    """(fixed_s, per_miss_s): the least-squares line through samples of the GPU's part of a layer, its misses the
    GPU computed and its seconds (arrays alike). None while the samples cannot tell (fewer than
    ``GPU_LINE_MIN_SAMPLES``, a single miss count) or when the slope is not within 0.25x..4x of ``probe_s``, the
    link figure the start-up probe measured (a stalled step must not steer the split). In closed form: it runs on
    the decode step's path."""
    n, s = np.asarray(misses, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if n.size < GPU_LINE_MIN_SAMPLES:
        return None
    dn = n - n.mean()
    spread = float(dn @ dn)
    if spread <= 1e-9:  # a single miss count: no slope
        return None
    per_miss = float(dn @ (s - s.mean())) / spread
    fixed = float(s.mean()) - per_miss * float(n.mean())
    if not (0.25 * probe_s <= per_miss <= 4 * probe_s) or not np.isfinite(fixed):
        return None
    return max(fixed, 0.0), per_miss


class Window:
    """The latest ``capacity`` rows of a few float columns, in preallocated arrays (a deque of tuples costs a
    conversion per read, on the decode step's path)."""

    def __init__(self, capacity: int, columns: int):
        self._data = np.zeros((capacity, columns), dtype=np.float64)
        self._next, self._full = 0, False

    def append(self, *row: float) -> None:
        self._data[self._next] = row
        self._next = (self._next + 1) % len(self._data)
        self._full = self._full or self._next == 0

    def __len__(self) -> int:
        return len(self._data) if self._full else self._next

    def columns(self) -> tuple[np.ndarray, ...]:
        """Each column's values (in no particular order)."""
        rows = self._data if self._full else self._data[: self._next]
        return tuple(rows.T)


def _measured_at(figures: Mapping[int, float], tokens: int) -> int:
    """The smallest measured token count >= ``tokens``, else the largest measured."""
    return min((t for t in figures if t >= tokens), default=max(figures))


def measure_cpu(experts: Sequence[tuple[ce.Linear, ce.Linear, ce.Linear]], *, act_limit: float, pool: ce.Pool | None,
                tokens: Sequence[int] = TOKENS, batch: int = 8, repeats: int = 3, isa: str | None = None,
                codebook: str = "fp16", seed: int = 0) -> tuple[dict[int, float], dict[int, float]]:
    """``(cpu_expert_s, cpu_job_s)`` of the CPU kernel on these experts (the checkpoint's own, read where the host
    store holds them) with ``pool``: per token count, jobs of one expert and jobs of ``batch`` experts are timed
    (the best of ``repeats`` passes over all the experts: cycling through many keeps the reads coming from DRAM, as
    in decode); each expert beyond the first adds ``(batch job - one-expert job) / (batch - 1)``, and a job costs
    the rest. :raise ValueError: fewer experts than ``batch`` (at least 2)."""
    if batch < 2 or len(experts) < batch:
        raise ValueError(f"need a batch of at least 2 and at least that many experts, got {batch} and {len(experts)}")
    rng = np.random.default_rng(seed)
    hidden = experts[0][0].in_features
    per_expert: dict[int, float] = {}
    per_job: dict[int, float] = {}
    def job_seconds(x: np.ndarray, size: int) -> float:
        """The best of ``repeats`` passes over the experts in jobs of ``size``, per job."""
        weights = np.full((size, x.shape[0]), 0.125, np.float32)
        acc = np.zeros(x.shape, np.float32)
        # laid out once: the worker calls the kernel natively, so the timing must not count Python's marshalling
        groups = [ce.ExpertTable(experts[i : i + size]) for i in range(0, len(experts) - size + 1, size)]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for group in groups:
                ce.experts_forward(x, group, weights, acc, act_limit=act_limit, isa=isa, pool=pool, codebook=codebook)
            best = min(best, (time.perf_counter() - t0) / len(groups))
        return best

    for t in tokens:
        x = rng.standard_normal((t, hidden)).astype(np.float16)
        one, many = job_seconds(x, 1), job_seconds(x, batch)
        # a floor of a tenth of the batch's average: timing noise must not make an expert look free
        per_expert[t] = max((many - one) / (batch - 1), 0.1 * many / batch)
        per_job[t] = max(one - per_expert[t], 0.0)
    return per_expert, per_job


def every_miss_to_the_cpu(costs: Costs) -> Costs:
    """Costs under which the split sends every missed expert to the CPU tier (a free CPU): for checks of the CPU
    path's numerics (bench/decode_kl.py ``--split all``, the GPU tests), never for speed."""
    return replace(costs, cpu_expert_s={t: 1e-12 for t in TOKENS}, cpu_job_s={}, handoff_s=0.0, cpu_pinned=True, forced=True,
                   sources={**costs.sources, "cpu_expert_s": "every miss to the CPU (a check, not a measurement)"})


def pinned_cpu_cost(ms: float, tokens: Sequence[int] = TOKENS) -> dict[int, float]:
    """``GLM53_CT_B``: one per-expert CPU time (ms) for every token count."""
    return {t: ms / 1000.0 for t in tokens}


def split_reference(sel: np.ndarray, rw: np.ndarray, slot_of: np.ndarray, freq: np.ndarray, table: np.ndarray) \
        -> tuple[list[tuple[int, int, float]], np.ndarray, dict[str, int]]:
    """What the device's split kernel (``ct_split_publish_kernel``) does with one decode step's routing, on the host:
    the reference its GPU test compares against, and the algorithm in readable form.

    :param sel: int ``[T, topk]`` picked experts; ``rw``: fp16 ``[T, topk]`` their router weights.
    :param slot_of: int ``[E]``, the expert's VRAM slot or -1; ``freq``: float32 ``[E]``, its decayed pick score.
    :param table: :meth:`Costs.table`.
    :return: the CPU job's picks (token, expert, weight) in pick order, the weights the GPU keeps (the CPU's picks
        zeroed), and hits / misses / experts / picks counts. Nothing is sent (and the weights are unchanged) when no
        expert is cold or the step is outside the table.
    """
    T, topk = sel.shape
    flat = [int(e) for e in sel.reshape(-1)]
    distinct = list(dict.fromkeys(flat))
    missed = [e for e in distinct if slot_of[e] < 0]
    hits, misses = len(distinct) - len(missed), len(missed)
    k = 0
    if T < table.shape[0] and hits + misses < table.shape[1]:
        k = min(int(table[T, hits, misses]), misses)
    cold = set(sorted(missed, key=lambda e: (np.float32(freq[e]), e))[:k])
    weights = rw.astype(np.float16).reshape(-1).copy()
    picks = []
    for i, e in enumerate(flat):
        if e in cold:
            picks.append((i // topk, e, float(np.float32(weights[i]))))
            weights[i] = 0
    return picks, weights.reshape(T, topk), {"hits": hits, "misses": misses, "experts": len(cold), "picks": len(picks)}
