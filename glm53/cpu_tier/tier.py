"""Fast mode's CPU tier put into a running offload: per MoE layer and decode step, the coldest missed experts are
computed by a host worker from the host store (the single copy) while the GPU computes the hits and the other
misses; the worker's fp32 partial is added to the layer's fp32 routed sum before it is rounded.

Per layer, on the compute stream, with no host synchronisation (the engine's hooks call in: ``on_routing`` and
``on_routed_sum``, installed by ``glm53.engine.exl3.patches.hook_offload``):

1. after routing and the expert cache's step: ``ct_split_publish`` picks the experts for the CPU from the cost
   table (``split``), publishes the job and zeroes those picks' router weights, which exllamav3's fused decode
   kernels skip;
2. exllamav3 computes the rest;
3. on the fp32 routed sum: ``ct_collect`` waits up to ``GLM53_CT_DEADLINE_MS`` for the job and adds its partial, or
   takes it back; then the GPU FALLBACK: ``ct_fallback_plan`` and exllamav3's fused expert kernel (the
   ``fallbacks`` the engine hands over) compute, into the same fp32 sum, the experts of a job that was taken back
   or refused (nothing, when it arrived). Every routed expert is in every step; the fallbacks are counted
   (``/stats``: ``cpu_tier.device.fallback_jobs``).

The GPU's wait for a job is a stop-loss: at most the time it would take to read the job's experts over the link
itself (at least ``STOP_LOSS_FLOOR_S``, never over the deadline), so a late job costs about twice its experts' link
time, not a deadline.

The split follows the host's live rate: the cost table is rebuilt every ``REFRESH_STEPS`` steps from live timings
(:meth:`after_step`): late jobs (more than ``LATE_SHARE`` of a window's: the CPU figures become ``SLOWER`` times what
the window's busy time shows, never compounding; they come down again slowly), the worker's busy time per expert (a slower host is seen within a refresh), jobs the worker
never claimed (a starved host: its CPU figures rise until the table sends nothing), and the GPU's own time for its
part of every layer of one step in ``SAMPLE_STEPS`` (two CUDA events a layer, read after the step's
synchronisation). The refresh runs between two steps, on the thread feeding the GPU, so it is kept to a few hundred
microseconds: closed forms over preallocated windows, and the table rebuilt only when its figures moved by more
than ``TABLE_DRIFT``.

While the tier RESTS (the table sends the CPU nothing, or its saving does not pay for its hooks: :class:`Worth`) it
launches nothing but PROBE steps, which publish shadow jobs (the GPU computes those experts as well) whose busy time
tells when the host has become fast enough again; the costs are refreshed only from them. A probe step costs the
decode a few milliseconds (the pool's threads wake beside the thread feeding the GPU), so probes start one step in
``PROBE_STEPS`` and their interval doubles, up to ``PROBE_STEPS_MAX``, after each probe whose live figures, taken
outright, would not have the split save ``PROBE_NEAR`` of its hooks' cost (measured on the H200 host: probes one
step in 8 and a refresh every 8 steps took 11 % off a resting tier's decode; a rule that kept the interval short
while the model's CPU figure came down step by step from a raise still took 3-8 %; bench/fast_ablation.py). Only a
host that is near paying is probed often: then its model catches up with the live figure within a few probes.

Threads: the worker thread takes part in every job it runs, so it is pinned to the first of the tier's CPUs
(``GLM53_CT_CPUS``) and the pool's threads to the others: one compute thread per CPU; and while the tier runs, the
thread feeding the GPU keeps to the CPUs the tier leaves (:class:`FeedingThread`). A job waits for its slowest
unit: a compute thread that shares its CPU with a busy thread loses whole scheduler slices. Between a token's
layers (about a millisecond) the pool and the worker spin instead of sleeping: the engine wakes the worker before
every step that may publish jobs (:meth:`before_step`), it spins until the step is over (:meth:`after_step`) and
``SPIN_US`` after, and with no decode in flight for ``PARK_US`` it parks (an idle server costs no CPU).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch

from . import kernel as ce
from .device import OUTCOMES, CtKernels, DeviceProducer, pack_picks
from .split import Costs, Window, fit_gpu_line, measure_cpu, pinned_cpu_cost
from .worker import ExpertTable, Ring, Worker, host_store_experts

log = logging.getLogger(__name__)

MAX_TOKENS = 8  # decode rows per step the CPU tier takes (exllamav3's fused decode tier, MAX_BSZN)
RING_SLOTS = 4  # a layer's job is collected before the next layer publishes; spare slots cover late workers
TIMING_EXPERTS = 32  # experts the CPU figure is timed on at start
REFRESH_STEPS = 8  # steps between refreshes of the cost table from live timings (a busy host is seen this soon)
SAMPLE_STEPS = 8  # one decode step in this many has its layers' GPU part timed
GPU_SAMPLES = 768  # the latest timed layers the GPU's line is fitted to
SPIN_US = 5000  # the tier's threads spin this long after a job before sleeping: longer than the gap between two steps
PARK_US = 50_000  # the worker parks after this long without a decode step
PROBE_STEPS = 8  # resting, the first probe step comes this many steps after the rest began
PROBE_STEPS_MAX = 512  # ... and the interval doubles up to this after each probe that did not lower the CPU figures
PROBE_NEAR = 0.5  # resting, a probe whose live figures would have the split save this share of the hooks' cost
# (or, the hooks not yet timed, save anything) keeps the next probe PROBE_STEPS away: the host is near paying
TABLE_DRIFT = 0.03  # a refresh rebuilds the split table when a figure it is built from moved by more than this share
PROBE_EXPERTS = 2  # experts of a shadow job
STARVED_SHARE = 0.1  # a refresh window whose jobs went unclaimed past their deadline more often than this: starved
LATE_SHARE = 0.05  # a refresh window with more late jobs (computed by the GPU after all) than this: the CPU is slower
SLOWER = 2.0  # ... and its figures are multiplied by this (they come back down by at most 1.25x a clean window)
STOP_LOSS_FLOOR_S = 300e-6  # the GPU waits at least this long for a job (its jitter), at most its experts' link time
LAYER_SAMPLES = 768  # the latest sampled layers' (tokens, hits, misses) the split's saving is predicted over
# the hooks' parts, timed on the host for /stats (where a layer's host time goes: bench/fast_ablation.py)
HOOK_PARTS = ("split_publish", "collect", "fallback_plan", "fallback_launch")
HOOK_MARGIN = 1.25  # resting for its hooks' cost, the tier comes back once its predicted saving is this much higher
HOOK_WEIGHT = 1.0  # the share of the hooks' cost per layer counted against the split's saving (bench.fast_ablation's
# no-rest run sets 0: is that cost real at all while the thread feeding the GPU runs milliseconds ahead of it?)
HOOK_COST = "host"  # what the hooks cost, for Worth: "host", the feeding thread's time in them; "gpu", their time on the
# GPU's clock in sampled layers that sent the CPU nothing (the split, and the collect to the fallback's launch), the
# currency of the split's own table (bench.fast_ablation's gpu-worth run)


class Worth:
    """Whether taking part in decode pays for the tier's hooks. On every layer it takes part in, the thread feeding
    the GPU spends host time launching the split, the collect and the GPU fallback (a decode step of a small batch
    is bound by that thread's launches: on the H200 host, a tier that took under 1 % of the misses made the step
    6 % slower than exact mode's, about 90 us a layer), a cost the split's table does not see. So the table's
    predicted saving of a layer, averaged over sampled layers (their tokens, hits and misses, the table's ``k``),
    is set against the hooks' measured host time per layer: below it the tier RESTS (no launches, as in exact
    mode, but for probe steps); it comes back once the saving is ``HOOK_MARGIN`` times the hooks' cost. Never with a
    check's forced costs (``split.every_miss_to_the_cpu``). The hooks' cost is their host time, or with ``HOOK_COST``
    "gpu" their time on the GPU's clock in sampled layers (the split table's currency: host time costs the step
    nothing while the feeding thread runs ahead of the GPU, which it did by ~10 ms a step on the H200 host)."""

    def __init__(self):
        self.samples = Window(LAYER_SAMPLES, 3)  # (tokens, hits, misses)
        self.hook_s: float | None = None  # the hooks' host seconds per layer, over the latest window that had any
        self.gpu_samples = Window(LAYER_SAMPLES, 1)  # the hooks' GPU seconds in sampled layers that sent the CPU nothing
        self.saving_s: float | None = None  # the split's predicted saving per layer
        self.resting = False
        self._sum, self._layers = 0.0, 0

    def hooked(self, seconds: float) -> None:
        """A layer's hooks took this much host time."""
        self._sum += seconds
        self._layers += 1

    def sampled(self, tokens: int, hits: int, misses: int) -> None:
        self.samples.append(tokens, hits, misses)

    def gpu_hooked(self, seconds: float) -> None:
        """A sampled layer's hooks took this long on the GPU's clock."""
        self.gpu_samples.append(seconds)

    @property
    def hook_gpu_s(self) -> float | None:
        return float(self.gpu_samples.columns()[0].mean()) if len(self.gpu_samples) else None

    def hook_cost_s(self) -> float | None:
        """What the hooks cost a layer, in ``HOOK_COST``'s currency (the GPU's, before any layer was timed: the host's)."""
        gpu = self.hook_gpu_s if HOOK_COST == "gpu" else None
        return gpu if gpu is not None else self.hook_s

    def predicted_saving(self, costs: Costs, table) -> float | None:
        """The split's mean saving per sampled layer under ``costs`` (``table``: their split table), in seconds; None
        before any layer was sampled."""
        if not len(self.samples):
            return None
        t, h, m = (c.astype(np.int64) for c in self.samples.columns())
        return float(costs.savings(t, h, m, table[t, h, m]).mean())

    def decide(self, costs: Costs, table) -> bool:
        """Rests or comes back by this window's figures (``table``: ``costs``' split table, host side); True when
        that changed."""
        if self._layers:
            self.hook_s, self._sum, self._layers = self._sum / self._layers, 0.0, 0
        before = self.resting
        if costs.forced:  # a check of the CPU path (every miss to the CPU): it must keep running
            self.resting = False
            return before != self.resting
        cost = self.hook_cost_s()
        if cost is None or not len(self.samples):
            return False
        self.saving_s = self.predicted_saving(costs, table)
        self.resting = self.saving_s < HOOK_WEIGHT * cost * (HOOK_MARGIN if self.resting else 1.0)
        return self.resting != before

    def stats(self) -> dict:
        us = {k: None if v is None else round(v * 1e6, 1) for k, v in (("hooks_us_per_layer", self.hook_s),
                                                                       ("hooks_gpu_us_per_layer", self.hook_gpu_s),
                                                                       ("saving_us_per_layer", self.saving_s))}
        return {**us, "hook_cost": HOOK_COST, "resting": self.resting, "layers_sampled": len(self.samples)}


class FeedingThread:
    """Keeps the thread that feeds the GPU (the one that starts the tier: the engine's) off the CPU tier's CPUs
    while the tier runs: ``confine()`` moves it to the CPUs this process may use less ``tier``, and caps torch's
    CPU threads at their count (torch starts its pool lazily, from this thread, inheriting its CPUs);
    ``release()`` undoes both. Other threads, mostly idle, are left where they are. Nothing is moved when the tier
    takes every CPU (a warning says so)."""

    def __init__(self, tier: tuple[int, ...]):
        self.allowed = set(os.sched_getaffinity(0))
        self.rest = self.allowed - set(tier)
        self._torch_threads: int | None = None
        self.confined = False  # asked to keep off the tier's CPUs (also when there is nowhere else to go)

    def confine(self) -> None:
        self.confined = True
        if not self.rest:
            log.warning("CPU tier: GLM53_CT_CPUS takes every CPU of this process; the thread feeding the GPU shares "
                        "them and slows the tier's jobs (leave one CPU out)")
            return
        os.sched_setaffinity(0, self.rest)  # 0: the calling thread
        self._torch_threads = torch.get_num_threads()
        torch.set_num_threads(min(self._torch_threads, len(self.rest)))

    def release(self) -> None:
        self.confined = False
        if self._torch_threads is not None:
            os.sched_setaffinity(0, self.allowed)
            torch.set_num_threads(self._torch_threads)
            self._torch_threads = None


class FastTier:
    def __init__(self, settings, store, cache, device: torch.device, kernels, fallbacks: Sequence[Callable], top_k: int,
                 act_limit: float):
        """
        :param store: the loaded, pinned host store (``glm53.offload.host_store.HostStore``): the experts are read
            where its arenas hold them, and its sign/scale vectors from the checkpoint it was scanned from.
        :param cache: the expert cache (``glm53.offload.cache.ExpertCache``): its ``slot_of`` and ``freq`` device
            tensors tell the split which experts are missed and which are cold.
        :param kernels: the expert cache's kernels (``glm53.offload.ec_native.Kernels``): its library holds the
            tier's device side too. The link is timed at start through the cache's (``cache.link``: an emulated one's
            rate, when it emulates).
        :param fallbacks: per MoE layer (in store order), the GPU's fused expert kernel for the picks a job did not
            deliver (``run(y, acc, count, token_sorted, weight_sorted)``, ``glm53.engine.exl3.patches.fused_experts``).
        :param top_k: experts picked per token. :param act_limit: GLM's ``swiglu_limit`` (0: no clamp).
        """
        t0 = time.monotonic()
        self.store, self.cache, self.device = store, cache, device
        self.codebook = settings.ct_codebook
        self.hidden = store.layout.shapes[0][0] * 16
        self.top_k = top_k
        self.fallbacks = list(fallbacks)  # per layer row, in store order
        experts = host_store_experts(store, store.read_sign_scale(settings.model_dir))
        self.table = ExpertTable(experts, store.num_layers, store.num_experts)
        pool, worker_cpu = ce.Pool.for_caller(settings, spin_us=SPIN_US)  # the worker thread is the caller
        self.feeding = FeedingThread(pool.cpus if worker_cpu is None else (worker_cpu, *pool.cpus))
        self.feeding.confine()
        self.pool = self.worker = self.producer = None
        try:
            self.pool = pool.start()
            self.ring = Ring(RING_SLOTS, self.hidden, MAX_TOKENS, top_k)
            self.worker = Worker(self.ring, self.table, act_limit=act_limit, pool=self.pool, cpu=worker_cpu, spin_us=SPIN_US,
                                 park_us=PARK_US, codebook=self.codebook).start()
            self.producer = DeviceProducer(self.ring, device, CtKernels(kernels.path))  # the library of the cache's kernels
            self.max_experts = min(255, MAX_TOKENS * top_k)
            self.costs = self._measure(settings, experts, act_limit)
            self._table = self.costs.table(MAX_TOKENS, self.max_experts)  # host side (the worth's predictions)
            self.cube = torch.from_numpy(self._table).to(device)
            self.cpu_off = not bool(self._table.any())  # the table sends the CPU nothing: probe now and then
        except BaseException:
            self.close()  # what started stops, and the feeding thread gets its CPUs back
            raise
        self._steps, self._seen, self._seen_device = 0, self.worker.counters(), self.producer.stats()
        self._probing = False  # this step publishes shadow jobs (resting)
        self._probe_every = PROBE_STEPS  # resting: steps between probes (doubling while probes lower nothing)
        self._until_probe = PROBE_STEPS  # resting: steps left before the next probe
        self._probe_refresh = False  # the next step's end refreshes the costs from the last probe's jobs
        self._probe_live: Costs | None = None  # the last refresh's live CPU figures taken outright (None: late, starved, no jobs)
        self._table_costs = self.costs  # the costs the split table was built from
        self.worth = Worth()
        self._hook_s = 0.0  # host time of the current layer's routing hook
        self.hook_parts = np.zeros(len(HOOK_PARTS))  # host seconds of each part of the hooks, over the layers taken part in
        self.hooked_layers = 0
        self._probe_link_s = self.costs.link_expert_s  # the start-up probe's figure, a live line's sanity range
        self._sampling = False  # this step's layers are timed
        # (layer row, before the split, after it, split counts, tokens)
        self._open_sample: tuple[int, torch.cuda.Event, torch.cuda.Event, torch.Tensor, int] | None = None
        # [before the split, after it, before the collect, after the fallback's launch (None: no collect), counts, tokens]
        self._step_samples: list[list] = []
        self._gpu_samples = Window(GPU_SAMPLES, 2)  # (GPU misses, seconds)
        self.deadline_s = settings.ct_deadline_ms / 1000.0
        self.sent = torch.zeros(4, dtype=torch.int64, device=device)  # hits, misses, experts, picks sent (decode steps)
        self.skipped = 0  # routing calls the tier could not take (too many rows, other dtypes)
        # the layer's job in flight: (layer row, job status, tokens, the split's record, the experts' input rows, its info)
        self._pending: tuple[int, torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.enabled = True  # off: every expert on the GPU, exact mode's numerics (paired checks, bench/decode_kl.py)
        self.setup_s = round(time.monotonic() - t0, 2)
        log.info("CPU tier: %d threads (worker on CPU %s), %s codebook, costs per expert: CPU %s us (+ %s us a job), link %.0f us, VRAM "
                 "%.1f us, handoff %.0f us (%s)", self.pool.threads + 1, worker_cpu, self.codebook,
                 {t: round(v * 1e6) for t, v in self.costs.cpu_expert_s.items()},
                 {t: round(v * 1e6) for t, v in self.costs.cpu_job_s.items()},
                 self.costs.link_expert_s * 1e6, self.costs.vram_expert_s * 1e6, self.costs.handoff_s * 1e6, self.costs.sources)

    # ---- start-up measurements (the cost model's constants, on this machine)

    def _measure(self, settings, experts, act_limit: float) -> Costs:
        sources = {}
        if settings.ct_b is not None:
            cpu, job, sources["cpu_expert_s"] = pinned_cpu_cost(settings.ct_b), {}, "GLM53_CT_B"
        else:
            keys = sorted(experts)[:TIMING_EXPERTS]
            cpu, job = measure_cpu([experts[k] for k in keys], act_limit=act_limit, pool=self.pool, batch=min(8, len(keys)),
                                   codebook=self.codebook)
            sources["cpu_expert_s"] = f"timed on {len(keys)} experts at start, jobs of 1 and {min(8, len(keys))}"
        block = self.store.layout.block_bytes
        link_gbs = _link_read_gbs(self.store, self.cache.link)
        vram_gbs = _vram_read_gbs(self.device)
        one = min(cpu)
        handoff = max(0.0, self._round_trip_s() - cpu[one] - job.get(one, 0.0))
        sources.update(link_expert_s=f"zero-copy read {link_gbs:.1f} GB/s", vram_expert_s=f"VRAM read {vram_gbs:.0f} GB/s",
                       handoff_s="one-expert round trip less its CPU time")
        return Costs(cpu, handoff_s=handoff, link_expert_s=block / (link_gbs * 1e9), vram_expert_s=block / (vram_gbs * 1e9),
                     sources=sources, cpu_job_s=job, cpu_pinned=settings.ct_b is not None)

    def remeasure_link(self) -> None:
        """The link's figure timed again through the offload's link, and the GPU's live line started over: after the
        link changed under a running engine (a measurement tool's ``Link.retarget``), the split follows it from the
        next step instead of refusing live lines far from the start-up figure."""
        gbs = _link_read_gbs(self.store, self.cache.link)
        self._probe_link_s = self.store.layout.block_bytes / (gbs * 1e9)
        self._gpu_samples = Window(GPU_SAMPLES, 2)
        self.worth = Worth()  # whether the split pays is decided afresh on the new link
        self._probe_every = self._until_probe = PROBE_STEPS
        self.use_costs(replace(self.costs, link_expert_s=self._probe_link_s, gpu_fixed_s=0.0,
                               sources={**self.costs.sources, "link_expert_s": f"zero-copy read {gbs:.1f} GB/s (timed again)"}))

    def use_costs(self, costs: Costs) -> None:
        """Split by these costs from the next step on (the device's table is rewritten in place, on the stream)."""
        self.costs = self._table_costs = costs
        self._table = costs.table(MAX_TOKENS, self.max_experts)
        self.cpu_off = not self._table.any()
        self.cube.copy_(torch.from_numpy(self._table))

    def _adopt(self, costs: Costs) -> None:
        """A refresh's costs: kept as the model, the table rebuilt only past ``TABLE_DRIFT`` (or when the CPU's
        share may change sign: the table sends it nothing, or the new figures are a check's)."""
        if self.cpu_off or costs.forced or costs.table_drift(self._table_costs, MAX_TOKENS) > TABLE_DRIFT:
            self.use_costs(costs)
        else:
            self.costs = costs

    @property
    def resting(self) -> bool:
        """The tier launches nothing but probes: its table sends the CPU nothing, or its saving is below its hooks'
        cost (:class:`Worth`)."""
        return self.cpu_off or self.worth.resting

    def worthwhile(self) -> tuple[bool, str]:
        """Whether the measured costs give the CPU any share of a decode step's misses, and why (for
        ``GLM53_CT_ENABLE=auto``)."""
        c = self.costs
        one = c.cpu_seconds(1, 1)
        why = (f"a one-expert CPU job costs {one * 1e6:.0f} us, reading the expert over the link {c.link_expert_s * 1e6:.0f} "
               f"us (the GPU's fixed part of a layer {c.gpu_fixed_s * 1e6:.0f} us)")
        return not self.cpu_off, why

    def _round_trip_s(self, jobs: int = 20) -> float:
        """The median GPU-side time of a one-expert job, published and collected, with the worker awake as in a decode
        step (asleep, each job would wait out its nap: on the H200 host a start-up measurement without the wake-up
        once gave 1.8 ms of handoff, which no live figure corrects, and kept the tier at rest)."""
        x = torch.zeros((1, self.hidden), dtype=torch.float16, device=self.device)
        picks = pack_picks(torch.tensor([0]), torch.tensor([0]), torch.tensor([0.5])).to(self.device)
        acc = torch.zeros((1, self.hidden), dtype=torch.float32, device=self.device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(jobs)]
        self.worker.wake()
        try:
            self.producer.collect(self.producer.publish(0, x, picks), acc, 1.0)  # warm-up
            for start, end in events:
                start.record()
                self.producer.collect(self.producer.publish(0, x, picks), acc, 1.0)
                end.record()
            events[-1][1].synchronize()
        finally:
            self.worker.rest()
        return float(np.median([start.elapsed_time(end) for start, end in events])) / 1000.0

    # ---- per layer (the offload's hooks call these on the compute stream)

    def on_routing(self, row: int, selected: torch.Tensor, weights: torch.Tensor, z: torch.Tensor) -> None:
        """After the layer's routing and the cache's step, before its experts run. While the table sends the CPU
        nothing (a busy or slow host) and this is no probe step, nothing is launched: the layer runs as in exact
        mode, at its cost."""
        if not self.enabled or (self.resting and not self._probing):
            return
        t0 = time.perf_counter()
        T = selected.shape[0]
        if T > MAX_TOKENS or weights.dtype != torch.float16 or z.dtype != torch.float16 or not (
                selected.is_contiguous() and weights.is_contiguous() and z.is_contiguous()):
            self.skipped += 1
            return
        y = z.view(T, self.hidden)  # the experts see the router's input (checked at start)
        pre = None
        if self._sampling:
            pre = self._event()
            pre.record()
        status, info, record = self.producer.split_publish(row, selected, weights, y, self.cache.slot_of[row],
                                                           self.cache.freq[row], self.cube,
                                                           PROBE_EXPERTS if self._probing else 0)
        self.sent += info
        if not self._probing:  # a shadow job is never collected
            self._pending = (row, status, T, record, y, info)
        if self._sampling:
            start = self._event()
            start.record()
            self._open_sample = (row, pre, start, info, T)
        self._hook_s = time.perf_counter() - t0
        if not self._probing:
            self.hook_parts[0] += self._hook_s

    def on_routed_sum(self, row: int, final_hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer's fp32 routed sum: the CPU's partial is added in place."""
        sample = None
        if self._open_sample is not None and self._open_sample[0] == row:
            end = self._event()
            end.record()  # before the wait for the CPU: the GPU's own part of the layer (a probe step's too)
            _, pre, start, info, tokens = self._open_sample
            sample = [pre, start, end, None, info, tokens]
            self._step_samples.append(sample)
            self._open_sample = None
        if self._pending is None or self._pending[0] != row:
            return final_hidden_states
        t0 = time.perf_counter()
        _, status, T, record, y, info = self._pending
        self._pending = None
        acc = final_hidden_states.view(-1, final_hidden_states.shape[-1])
        if acc.dtype != torch.float32 or not acc.is_contiguous() or acc.shape[-1] != self.hidden:
            raise RuntimeError(f"layer {row}: the routed sum is {acc.dtype} {tuple(acc.shape)}; the CPU tier needs a "
                               f"contiguous fp32 [tokens, {self.hidden}] (exllamav3's internals changed)")
        # a stop-loss wait: no longer than the GPU would take to read the job's experts itself (never over the deadline)
        outcome = self.producer.collect(status, acc[:T], self.deadline_s, info, self.costs.link_expert_s, STOP_LOSS_FLOOR_S)
        t1 = time.perf_counter()
        count, token_sorted, weight_sorted = self.producer.fallback_plan(status, outcome, record, T, self.top_k,
                                                                         self.store.num_experts)
        t2 = time.perf_counter()
        self.fallbacks[row](y, acc[:T], count, token_sorted, weight_sorted)
        link = self.cache.link
        link.tier_io(status, outcome, T * self.hidden * 2, T * self.hidden * 4)
        link.fallback(self.cache.state, row, count, self.cache.block_bytes)
        if sample is not None:
            sample[3] = self._event()
            sample[3].record()  # the collect and the fallback: with no job, all of it is the hooks' own GPU time
        t3 = time.perf_counter()
        self.hook_parts[1:] += (t1 - t0, t2 - t1, t3 - t2)
        self.hooked_layers += 1
        self.worth.hooked(self._hook_s + t3 - t0)
        return final_hidden_states

    @contextmanager
    def paused(self):
        """Within: every expert is computed on the GPU (exact mode's numerics), on the same loaded model."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    # ---- per step and reporting

    def before_step(self) -> None:
        """Before the engine launches a step that may publish jobs: the worker spins through it. While the table
        sends the CPU nothing and this is no probe step, it is left to nap and park (the tier costs no CPU)."""
        if not self.resting or self._probing:
            self.worker.wake()

    def after_step(self) -> None:
        """Once per engine step, after its synchronisation: reads the step's timed layers and arms the timing of the
        next step every ``SAMPLE_STEPS``; running, refreshes the costs every ``REFRESH_STEPS`` steps; resting, arms
        the probes (their interval doubling while they lower nothing) and refreshes from each probe's jobs."""
        self.worker.rest()
        self._steps += 1
        self._read_samples()
        probed, self._probing = self._probing, False
        if self._probe_refresh:  # the step after a probe: its shadow jobs are in the worker's counters
            self._probe_refresh = False
            self._refresh()
            if self.resting:
                near = self._near_paying(self._probe_live)
                self._probe_every = PROBE_STEPS if near else min(2 * self._probe_every, PROBE_STEPS_MAX)
                self._until_probe = self._probe_every
        elif not self.resting and self._steps % REFRESH_STEPS == 0:
            self._refresh()
            if self.resting:  # it came to rest: the probes start over
                self._probe_every = self._until_probe = PROBE_STEPS
        if probed:
            self._probe_refresh = True
        elif self.resting:
            self._until_probe -= 1
            if self._until_probe <= 0:
                self._probing, self._until_probe = True, self._probe_every
        self._sampling = self._probing or self._steps % SAMPLE_STEPS == 0
        # resting, the thread feeding the GPU may use every CPU again, as in exact mode
        if self.resting and self.feeding.confined:
            self.feeding.release()
        elif not self.resting and not self.feeding.confined:
            self.feeding.confine()

    def _near_paying(self, live: Costs | None) -> bool:
        """Whether these live figures, taken outright, would have the split save at least ``PROBE_NEAR`` of the hooks'
        cost per layer (``Worth.hook_cost_s``) over the sampled layers (the hooks not yet timed: save anything; no
        layer sampled yet: send the CPU anything)."""
        if live is None:
            return False
        table = live.table(MAX_TOKENS, self.max_experts)
        saving = self.worth.predicted_saving(live, table)
        if saving is None:
            return bool(table.any())
        hook = self.worth.hook_cost_s()
        return saving > 0 and (hook is None or saving >= PROBE_NEAR * hook)

    @staticmethod
    def _event() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def _read_samples(self) -> None:
        """The timed layers of the step just synchronised: (the misses the GPU computed, its seconds)."""
        if self._step_samples:
            counts = torch.stack([sample[4] for sample in self._step_samples]).tolist()  # one transfer for the step
            for (pre, start, end, post, _, tokens), (hits, misses, cpu_experts, _) in zip(self._step_samples, counts):
                self._gpu_samples.append(misses - cpu_experts, start.elapsed_time(end) / 1000.0)
                self.worth.sampled(tokens, hits, misses)
                if post is not None and cpu_experts == 0:  # no job to wait for: the split, collect and fallback alone
                    self.worth.gpu_hooked((pre.elapsed_time(start) + end.elapsed_time(post)) / 1000.0)
        self._step_samples.clear()
        self._open_sample = None

    def _refresh(self) -> None:
        """The costs from the window since the last refresh (reads the device's counters: after a step's sync)."""
        now, device = self.worker.counters(), self.producer.stats()
        jobs, experts = now["jobs"] - self._seen["jobs"], now["experts"] - self._seen["experts"]
        busy, tokens = now["busy_s"] - self._seen["busy_s"], now["tokens"] - self._seen["tokens"]
        seen = self._seen_device
        unclaimed = device["taken_back_before_claim"] - seen["taken_back_before_claim"]
        published = device["published"] - seen["published"]
        late = device["fallback_jobs"] - seen["fallback_jobs"]
        collected = late + device["done"] - seen["done"]
        self._seen, self._seen_device = now, device
        fresh, self._probe_live = self.costs, None
        live = fresh.refreshed(busy, experts, -(-tokens // jobs), jobs, weight=1.0, ease=float("inf")) if jobs > 0 else None
        if late > max(1, LATE_SHARE * collected):
            # the worker's busy time does not see all of what makes a job late (its threads preempted, its wake-ups):
            # the split sends fewer until the windows are clean again, at SLOWER times what the window's busy time
            # shows (never compounding from window to window: a burst of late jobs does not outlast itself)
            fresh = (live or fresh).slower(SLOWER)
        elif live is not None:
            self._probe_live = live
            # resting, the window's jobs were probes, shadow jobs published to time the host: taken as they are (a
            # wrong guess costs a few late jobs, which the GPU computes and the next window sees); running, averaged
            # in and lowered by at most Costs.EASE a refresh
            fresh = live if self.resting else fresh.refreshed(busy, experts, -(-tokens // jobs), jobs)
        if unclaimed > max(1, STARVED_SHARE * published):
            self._probe_live = None
            # the worker did not even get to many of its jobs by their deadline: the host is starved (one such job
            # is a worker waking from a park; its experts were computed on the GPU anyway)
            fresh = fresh.starved()
        line = fit_gpu_line(*self._gpu_samples.columns(), self._probe_link_s)
        if line is not None:
            fresh = fresh.with_gpu_line(*line)
            self._probe_live = None if self._probe_live is None else self._probe_live.with_gpu_line(*line)
        if fresh is not self.costs:
            self._adopt(fresh)
        if self.worth.decide(self.costs, self._table):
            log.info("CPU tier %s: its split saves %.0f us a layer, its hooks cost %.0f us a layer (%s time)",
                     "resting" if self.worth.resting else "back", self.worth.saving_s * 1e6, self.worth.hook_cost_s() * 1e6,
                     "GPU" if HOOK_COST == "gpu" and self.worth.hook_gpu_s is not None else "host")

    def stats(self) -> dict:
        hits, misses, experts, picks = self.sent.tolist()
        return {
            "setup_s": self.setup_s,
            "threads": {"tier": self.pool.threads + 1, "feeding_thread_on_cpus": sorted(self.feeding.rest)},
            "codebook": self.codebook,
            "costs": {"cpu_expert_us": {t: round(v * 1e6, 1) for t, v in self.costs.cpu_expert_s.items()},
                      "cpu_job_us": {t: round(v * 1e6, 1) for t, v in self.costs.cpu_job_s.items()},
                      "link_expert_us": round(self.costs.link_expert_s * 1e6, 1), "gpu_fixed_us": round(self.costs.gpu_fixed_s * 1e6, 1),
                      "vram_expert_us": round(self.costs.vram_expert_s * 1e6, 2),
                      "handoff_us": round(self.costs.handoff_s * 1e6, 1), "sources": dict(self.costs.sources)},
            "split": {"hits": hits, "misses": misses, "cpu_experts": experts, "cpu_picks": picks, "skipped_calls": self.skipped,
                      "cpu_off": self.cpu_off},
            "worth": {**self.worth.stats(), "hook_parts_us_per_layer": {
                name: round(1e6 * v / self.hooked_layers, 1) if self.hooked_layers else None for name, v in zip(HOOK_PARTS, self.hook_parts)}},
            "device": self.producer.stats(),
            "worker": {**self.worker.counters(), "parked": self.worker.parked()},
            "deadline_ms": self.deadline_s * 1000,
            "outcomes": list(OUTCOMES),
        }

    def close(self) -> None:
        """Stops what has started (also after a failed start)."""
        for part, stop in ((self.producer, "close"), (self.worker, "stop"), (self.pool, "stop")):
            if part is not None:
                getattr(part, stop)()
        self.feeding.release()


def start(settings, store, cache, device: torch.device, kernels, fallbacks: Sequence[Callable], top_k: int,
          act_limit: float) -> tuple[FastTier | None, str | None]:
    """Fast mode's CPU tier started on a running offload (the arguments are :class:`FastTier`'s), or ``(None, why)``
    when ``GLM53_CT_ENABLE=auto`` and the costs it measured at start give it no share of a decode step's misses
    (then it is stopped again: no threads, no pinned CPUs)."""
    tier = FastTier(settings, store, cache, device, kernels, fallbacks, top_k, act_limit)
    worthwhile, why = tier.worthwhile()
    if settings.ct_enable == "auto" and not worthwhile:
        tier.close()
        off = f"the measured costs give it no share of the misses: {why}"
        log.info("CPU tier off (GLM53_CT_ENABLE=auto): %s; decode runs as in exact mode", off)
        return None, off
    log.info("CPU tier on (GLM53_CT_ENABLE=%s): %s", settings.ct_enable, why)
    return tier, None


def _link_read_gbs(store, link, max_bytes: int = 1 << 29) -> float:
    """SM reads of mapped host memory (the zero-copy miss path), 16 blocks, over one layer's arena, through the
    offload's link (an emulated one's rate, when it emulates)."""
    src = store.cuda_arena(0)[: min(max_bytes, store.cuda_arena(0).numel()) // 16 * 16]
    return link.read_rate_gbs(src, 16, reps=1)


def _vram_read_gbs(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Device memory copy rate, counted as bytes read plus written (a resident expert is read once per use)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * nbytes / (start.elapsed_time(end) / 1000.0) / 1e9


