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
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..cost_model import TOKENS, Costs
from . import kernel as ce



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
