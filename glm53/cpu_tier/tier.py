"""Fast mode's CPU tier put into a running offload: per MoE layer and decode step, the coldest missed experts are
computed by a host worker from the host store (the single copy) while the GPU computes the hits and the other
misses; the worker's fp32 partial is added to the layer's fp32 routed sum before it is rounded.

The tier is one of the offload's parts (``glm53.offload.part``: its hooks are called by ``offload.runtime.Offload``).
Per layer, on the compute stream, with no host synchronisation:

1. ``routed``, after routing and the expert cache's step: ``ct_split_publish`` picks the experts for the CPU from
   the cost table (``split``), publishes the job (a :class:`Job`) and zeroes those picks' router weights, which
   exllamav3's fused decode kernels skip;
2. exllamav3 computes the rest;
3. ``routed_sum``, on the fp32 routed sum: ``ct_collect`` waits up to ``GLM53_CT_DEADLINE_MS`` for the job and adds
   its partial, or takes it back; then the GPU FALLBACK: ``ct_fallback_plan`` and exllamav3's fused expert kernel
   (the ``fallbacks`` the engine hands over) compute, into the same fp32 sum, the experts of a job that was taken
   back or refused (nothing, when it arrived). Every routed expert is in every step; the fallbacks are counted
   (``/stats``: ``cpu_tier.device.fallback_jobs``).

The GPU's wait for a job is a stop-loss: at most the time it would take to read the job's experts over the link
itself (at least ``Tuning.stop_loss_floor_s``, never over the deadline), so a late job costs about twice its
experts' link time, not a deadline.

Between steps (``after_step``) the :class:`~glm53.cpu_tier.controller.Controller` follows the host's live rate from
the worker's and the device's counters and from timed layers (:class:`LayerSample`: CUDA events around the split,
the GPU's own part and the collect, read after the step's synchronisation); while it rests, the tier launches nothing
but its probe steps' shadow jobs. The costs it starts from are measured at start (``measure.measure_costs``).

Threads: the worker thread takes part in every job it runs, so it is pinned to the first of the tier's CPUs
(``GLM53_CT_CPUS``) and the pool's threads to the others: one compute thread per CPU; and while the tier runs, the
thread feeding the GPU keeps to the CPUs the tier leaves (:class:`FeedingThread`). A job waits for its slowest
unit: a compute thread that shares its CPU with a busy thread loses whole scheduler slices. Between a token's
layers (about a millisecond) the pool and the worker spin instead of sleeping: the engine wakes the worker before
every step that may publish jobs (:meth:`FastTier.before_step`), it spins until the step is over
(:meth:`FastTier.after_step`) and ``SPIN_US`` after, and with no decode in flight for ``PARK_US`` it parks (an
idle server costs no CPU).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..cost_model import MAX_TOKENS, Costs
from . import kernel as ce
from .controller import Controller, Counters, relinked_costs
from .device import OUTCOMES, CtKernels, DeviceProducer
from .measure import link_read_gbs, measure_costs
from .tuning import Tuning
from .worker import ArenaExperts, ExpertTable, Ring, Worker, host_store_experts

log = logging.getLogger(__name__)

RING_SLOTS = 4  # a layer's job is collected before the next layer publishes; spare slots cover late workers
SPIN_US = 5000  # the tier's threads spin this long after a job before sleeping: longer than the gap between two steps
PARK_US = 50_000  # the worker parks after this long without a decode step
# the hooks' parts, timed on the host for /stats (where a layer's host time goes: bench/fast_ablation.py)
HOOK_PARTS = ("split_publish", "collect", "fallback_plan", "fallback_launch")


@dataclass(slots=True)
class Job:
    """A layer's CPU job, from its split (``routed``) to its collect (``routed_sum``)."""

    row: int  # the MoE layer
    status: torch.Tensor  # the job's status on the device
    tokens: int
    record: torch.Tensor  # the split's record of its picks (the fallback's plan reads it)
    y: torch.Tensor  # the experts' input rows, fp16 [tokens, hidden]
    info: torch.Tensor  # the split's counts on the device: hits, misses, CPU experts, picks (int32 [4])


@dataclass(slots=True)
class LayerSample:
    """A timed layer of a sampled step: CUDA events before and after the split, before the collect (the GPU's own
    part of the layer ends) and after the fallback's launch (None: nothing collected)."""

    row: int
    before_split: torch.cuda.Event
    after_split: torch.cuda.Event
    info: torch.Tensor  # the split's counts (as Job.info)
    tokens: int
    before_collect: torch.cuda.Event | None = None
    after_fallback: torch.cuda.Event | None = None


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
    """The CPU tier, an offload part (``name``, the hooks it implements, ``stats``, ``close``)."""

    name = "cpu_tier"

    def __init__(self, settings, store, cache, device: torch.device, kernels, fallbacks: Sequence[Callable], top_k: int,
                 act_limit: float, tuning: Tuning | None = None, ram_tier=None):
        """
        :param store: the loaded, pinned host store (``glm53.offload.host_store.HostStore``): the experts are read
            where its arenas hold them, and its sign/scale vectors from the checkpoint it was scanned from.
        :param ram_tier: where host RAM holds only part of the experts (``glm53.offload.ram_tier.RamTier``, pinned
            and started): each expert is read where its ``home`` (``cache.home_host``) is in the tier's arena, and
            :meth:`repoint` follows it each time the RAM tier's part moves it (``TieredHome.on_rehome``). When a
            layer's job is published every pick not in VRAM is at its ``home`` (the part read it from disk first).
        :param cache: the expert cache (``glm53.offload.cache.ExpertCache``): its ``slot_of`` and ``freq`` device
            tensors tell the split which experts are missed and which are cold.
        :param kernels: the expert cache's kernels (``glm53.offload.ec_native.Kernels``): its library holds the
            tier's device side too. The link is timed at start through the cache's (``cache.link``: an emulated one's
            rate, when it emulates).
        :param fallbacks: per MoE layer (in store order), the GPU's fused expert kernel for the picks a job did not
            deliver (``run(y, acc, count, token_sorted, weight_sorted)``, ``glm53.engine.exl3.patches.fused_experts``).
        :param top_k: experts picked per token. :param act_limit: GLM's ``swiglu_limit`` (0: no clamp).
        :param tuning: how the controller follows the host (default: ``Tuning()``).
        """
        t0 = time.monotonic()
        self.store, self.cache, self.device = store, cache, device
        self.codebook = settings.ct_codebook
        self.hidden = store.layout.shapes[0][0] * 16
        self.top_k = top_k
        self.fallbacks = list(fallbacks)  # per layer row, in store order
        sign_scale = store.read_sign_scale(settings.model_dir)
        self.arena_experts = None if ram_tier is None else ArenaExperts(store, ram_tier, cache.home_host, sign_scale)
        if ram_tier is None:
            experts = timed = host_store_experts(store, sign_scale)
        else:
            experts = self.arena_experts.experts
            held = {key: lins for key, lins in experts.items() if ram_tier.policy.slot_of[key] >= 0}
            timed = held or experts  # the CPU's figure is timed on experts whose bytes are there now
        self.table = ExpertTable(experts, store.num_layers, store.num_experts)
        pool, worker_cpu = ce.Pool.for_caller(settings, spin_us=SPIN_US)  # the worker thread is the caller
        self.feeding = FeedingThread(pool.cpus if worker_cpu is None else (worker_cpu, *pool.cpus))
        self.feeding.confine()
        self._reader = self._keep_reader_off_the_tier(ram_tier)
        self.pool = self.worker = self.producer = None
        try:
            self.pool = pool.start()
            self.ring = Ring(RING_SLOTS, self.hidden, MAX_TOKENS, top_k)
            self.worker = Worker(self.ring, self.table, act_limit=act_limit, pool=self.pool, cpu=worker_cpu, spin_us=SPIN_US,
                                 park_us=PARK_US, codebook=self.codebook).start()
            self.producer = DeviceProducer(self.ring, device, CtKernels(kernels.path))  # the library of the cache's kernels
            costs = measure_costs(timed, ct_b=settings.ct_b, act_limit=act_limit, codebook=self.codebook, pool=self.pool,
                                  worker=self.worker, producer=self.producer, store=store, link=cache.link, device=device,
                                  hidden=self.hidden)
            self.controller = Controller(costs, min(255, MAX_TOKENS * top_k), self._counters(), tuning)
            self.cube = torch.from_numpy(self.controller.table).to(device)  # the split table the device reads
        except BaseException:
            self.close()  # what started stops, and the feeding thread gets its CPUs back
            raise
        self.deadline_s = settings.ct_deadline_ms / 1000.0
        self._job: Job | None = None  # the layer's job in flight
        self._open_sample: LayerSample | None = None  # the layer's, between its split and its collect
        self._step_samples: list[LayerSample] = []  # this step's timed layers
        self._hook_s = 0.0  # host time of the current layer's routing hook
        self.hook_parts = np.zeros(len(HOOK_PARTS))  # host seconds of each part of the hooks, over the layers taken part in
        self.hooked_layers = 0
        self.sent = torch.zeros(4, dtype=torch.int64, device=device)  # hits, misses, experts, picks sent (decode steps)
        self.skipped = 0  # routing calls the tier could not take (too many rows, other dtypes)
        self.repointed = 0  # experts the RAM tier moved, followed by the worker's table
        self.enabled = True  # off: every expert on the GPU, exact mode's numerics (paired checks, bench/decode_kl.py)
        self.setup_s = round(time.monotonic() - t0, 2)
        log.info("CPU tier: %d threads (worker on CPU %s), %s codebook, costs per expert: CPU %s us (+ %s us a job), link %.0f us, VRAM "
                 "%.1f us, handoff %.0f us (%s)", self.pool.threads + 1, worker_cpu, self.codebook,
                 {t: round(v * 1e6) for t, v in costs.cpu_expert_s.items()},
                 {t: round(v * 1e6) for t, v in costs.cpu_job_s.items()},
                 costs.link_expert_s * 1e6, costs.vram_expert_s * 1e6, costs.handoff_s * 1e6, costs.sources)

    def repoint(self, row: int, experts: np.ndarray, addresses: np.ndarray) -> None:
        """The RAM tier's part moved layer ``row``'s ``experts`` to ``addresses`` (device addresses in the tier's arena,
        their new ``home``): the worker reads them there from its next job. Called before the layer's split, so the
        layer's job reads each pick where its bytes are (``TieredHome.on_rehome``)."""
        self.worker.repoint(row, experts, self.arena_experts.trellises(addresses))
        self.repointed += int(len(experts))

    @property
    def costs(self) -> Costs:
        return self.controller.costs

    @property
    def tuning(self) -> Tuning:
        return self.controller.tuning

    def _counters(self) -> Counters:
        """The worker's and the device's totals (reads the device's counters: after a step's sync)."""
        return Counters.read(self.worker.counters(), self.producer.stats())

    def use_costs(self, costs: Costs) -> None:
        """Split by these costs from the next step on (the device's table is rewritten in place, on the stream)."""
        self.controller.use_costs(costs)
        self.cube.copy_(torch.from_numpy(self.controller.table))

    def remeasure_link(self) -> None:
        """The link's figure timed again through the offload's link, and the GPU's live line started over: after the
        link changed under a running engine (a measurement tool's ``Link.retarget``), the split follows it from the
        next step instead of refusing live lines far from the start-up figure."""
        gbs = link_read_gbs(self.store, self.cache.link)
        costs = relinked_costs(self.costs, self.store.layout.block_bytes / (gbs * 1e9), f"zero-copy read {gbs:.1f} GB/s (timed again)")
        self.controller.relinked(costs)
        self.cube.copy_(torch.from_numpy(self.controller.table))

    def retune(self, tuning: Tuning) -> None:
        """Follow ``tuning`` from the next step on."""
        self.controller.retune(tuning)

    @contextmanager
    def tuned(self, tuning: Tuning) -> Iterator[None]:
        """Within: ``tuning`` (a measurement tool's variant); the one before it after."""
        before = self.tuning
        self.retune(tuning)
        try:
            yield
        finally:
            self.retune(before)

    def worthwhile(self) -> tuple[bool, str]:
        """Whether the measured costs give the CPU any share of a decode step's misses, and why (for
        ``GLM53_CT_ENABLE=auto``)."""
        c = self.costs
        one = c.cpu_seconds(1, 1)
        why = (f"a one-expert CPU job costs {one * 1e6:.0f} us, reading the expert over the link {c.link_expert_s * 1e6:.0f} "
               f"us (the GPU's fixed part of a layer {c.gpu_fixed_s * 1e6:.0f} us)")
        return not self.controller.cpu_off, why

    # ---- per layer (the offload's hooks, on the compute stream)

    def routed(self, row: int, selected: torch.Tensor, weights: torch.Tensor, z: torch.Tensor) -> None:
        """After the layer's routing and the cache's step, before its experts run. While the tier rests and this is
        no probe step, nothing is launched: the layer runs as in exact mode, at its cost."""
        control = self.controller
        if not self.enabled or not control.launches:
            return
        t0 = time.perf_counter()
        T = selected.shape[0]
        if T > MAX_TOKENS or weights.dtype != torch.float16 or z.dtype != torch.float16 or not (
                selected.is_contiguous() and weights.is_contiguous() and z.is_contiguous()):
            self.skipped += 1
            return
        y = z.view(T, self.hidden)  # the experts see the router's input (checked at start)
        probing, sampling = control.probing, control.sampling
        before = None
        if sampling:
            before = self._event()
            before.record()
        status, info, record = self.producer.split_publish(row, selected, weights, y, self.cache.slot_of[row],
                                                           self.cache.freq[row], self.cube,
                                                           control.tuning.probe_experts if probing else 0)
        self.sent += info
        if not probing:  # a shadow job is never collected
            self._job = Job(row, status, T, record, y, info)
        if sampling:
            after = self._event()
            after.record()
            self._open_sample = LayerSample(row, before, after, info, T)
        self._hook_s = time.perf_counter() - t0
        if not probing:
            self.hook_parts[0] += self._hook_s

    def routed_sum(self, row: int, routed_sum: torch.Tensor) -> None:
        """The layer's fp32 routed sum: the CPU's partial and the GPU fallback's experts are added in place."""
        sample = self._open_sample
        if sample is not None and sample.row == row:
            sample.before_collect = self._event()
            sample.before_collect.record()  # before the wait for the CPU: the GPU's own part of the layer (a probe step's too)
            self._step_samples.append(sample)
            self._open_sample = None
        else:
            sample = None
        job = self._job
        if job is None or job.row != row:
            return
        t0 = time.perf_counter()
        self._job = None
        acc = routed_sum.view(-1, routed_sum.shape[-1])
        if acc.dtype != torch.float32 or not acc.is_contiguous() or acc.shape[-1] != self.hidden:
            raise RuntimeError(f"layer {row}: the routed sum is {acc.dtype} {tuple(acc.shape)}; the CPU tier needs a "
                               f"contiguous fp32 [tokens, {self.hidden}] (exllamav3's internals changed)")
        T = job.tokens
        # a stop-loss wait: no longer than the GPU would take to read the job's experts itself (never over the deadline)
        outcome = self.producer.collect(job.status, acc[:T], self.deadline_s, job.info, self.costs.link_expert_s,
                                        self.tuning.stop_loss_floor_s)
        t1 = time.perf_counter()
        count, token_sorted, weight_sorted = self.producer.fallback_plan(job.status, outcome, job.record, T, self.top_k,
                                                                         self.store.num_experts)
        t2 = time.perf_counter()
        self.fallbacks[row](job.y, acc[:T], count, token_sorted, weight_sorted)
        link = self.cache.link
        link.tier_io(job.status, outcome, T * self.hidden * 2, T * self.hidden * 4)
        link.fallback(self.cache.state, row, count, self.cache.block_bytes)
        if sample is not None:
            sample.after_fallback = self._event()
            sample.after_fallback.record()  # the collect and the fallback: with no job, all of it is the hooks' own GPU time
        t3 = time.perf_counter()
        self.hook_parts[1:] += (t1 - t0, t2 - t1, t3 - t2)
        self.hooked_layers += 1
        self.controller.worth.hooked(self._hook_s + t3 - t0)

    @contextmanager
    def paused(self):
        """Within: every expert is computed on the GPU (exact mode's numerics), on the same loaded model."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    # ---- per step (the offload's hooks, around the engine's step)

    def before_step(self) -> None:
        """Before the engine launches a step that may publish jobs: the worker spins through it. While the tier rests
        and this is no probe step, it is left to nap and park (the tier costs no CPU)."""
        if self.controller.launches:
            self.worker.wake()

    def after_step(self) -> None:
        """Once per engine step, after its synchronisation: the step's timed layers go to the controller, which
        decides the next step (``Controller.end_step``); resting, the thread feeding the GPU may use every CPU
        again, as in exact mode."""
        self.worker.rest()
        self._read_samples()
        if self.controller.end_step(self._counters):
            self.cube.copy_(torch.from_numpy(self.controller.table))
        resting = self.controller.resting
        if resting and self.feeding.confined:
            self.feeding.release()
            if self._reader is not None:  # the disk reader's threads too (their copies out of the bounce buffers)
                self._reader.set_cpus(None)
        elif not resting and not self.feeding.confined:
            self.feeding.confine()
            if self._reader is not None:
                self._reader.set_cpus(sorted(self.feeding.rest))

    @staticmethod
    def _event() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def _read_samples(self) -> None:
        """The timed layers of the step just synchronised, to the controller."""
        if self._step_samples:
            counts = torch.stack([sample.info for sample in self._step_samples]).tolist()  # one transfer for the step
            for sample, (hits, misses, cpu_experts, _) in zip(self._step_samples, counts):
                hook_gpu_s = None
                if sample.after_fallback is not None and cpu_experts == 0:  # no job to wait for: the hooks alone
                    hook_gpu_s = (sample.before_split.elapsed_time(sample.after_split)
                                  + sample.before_collect.elapsed_time(sample.after_fallback)) / 1000.0
                self.controller.sampled(sample.tokens, hits, misses, cpu_experts,
                                        sample.after_split.elapsed_time(sample.before_collect) / 1000.0, hook_gpu_s)
        self._step_samples.clear()
        self._open_sample = None

    # ---- reporting and shutdown

    def stats(self) -> dict:
        hits, misses, experts, picks = self.sent.tolist()
        costs = self.costs
        return {
            "setup_s": self.setup_s,
            "threads": {"tier": self.pool.threads + 1, "feeding_thread_on_cpus": sorted(self.feeding.rest)},
            "codebook": self.codebook,
            "state": self.controller.state.value,
            "costs": {"cpu_expert_us": {t: round(v * 1e6, 1) for t, v in costs.cpu_expert_s.items()},
                      "cpu_job_us": {t: round(v * 1e6, 1) for t, v in costs.cpu_job_s.items()},
                      "link_expert_us": round(costs.link_expert_s * 1e6, 1), "gpu_fixed_us": round(costs.gpu_fixed_s * 1e6, 1),
                      "vram_expert_us": round(costs.vram_expert_s * 1e6, 2),
                      "handoff_us": round(costs.handoff_s * 1e6, 1), "sources": dict(costs.sources)},
            "split": {"hits": hits, "misses": misses, "cpu_experts": experts, "cpu_picks": picks, "skipped_calls": self.skipped,
                      "cpu_off": self.controller.cpu_off},
            "worth": {**self.controller.worth.stats(), "hook_parts_us_per_layer": {
                name: round(1e6 * v / self.hooked_layers, 1) if self.hooked_layers else None for name, v in zip(HOOK_PARTS, self.hook_parts)}},
            "device": self.producer.stats(),
            "worker": {**self.worker.counters(), "parked": self.worker.parked()},
            "deadline_ms": self.deadline_s * 1000,
            "beside_ram_tier": self.arena_experts is not None, "repointed": self.repointed,
            "outcomes": list(OUTCOMES),
        }

    def _keep_reader_off_the_tier(self, ram_tier):
        """Beside a RAM tier, its disk reader's threads (started before the tier, on every CPU) move to the CPUs the
        tier leaves, as the feeding thread does, and back with it while the tier rests (:meth:`after_step`): a compute
        thread sharing its CPU loses whole scheduler slices, and a job waits for its slowest one. Returns the reader
        moved (None: none, or nowhere to go)."""
        if ram_tier is None or not self.feeding.rest:
            return None
        try:
            ram_tier.reader.set_cpus(sorted(self.feeding.rest))
        except ValueError as e:
            log.warning("CPU tier: the RAM tier's disk reader stays on every CPU (%s)", e)
            return None
        return ram_tier.reader

    def close(self) -> None:
        """Stops what has started (also after a failed start)."""
        for part, stop in ((self.producer, "close"), (self.worker, "stop"), (self.pool, "stop")):
            if part is not None:
                getattr(part, stop)()
        self.feeding.release()
        if self._reader is not None:
            self._reader.set_cpus(None)  # the reader outlives the tier (the RAM tier's part closes it)
            self._reader = None


def start(settings, store, cache, device: torch.device, kernels, fallbacks: Sequence[Callable], top_k: int,
          act_limit: float, ram_tier=None) -> tuple[FastTier | None, str | None]:
    """Fast mode's CPU tier started on a running offload (the arguments are :class:`FastTier`'s), or ``(None, why)``
    when ``GLM53_CT_ENABLE=auto`` and the costs it measured at start give it no share of a decode step's misses
    (then it is stopped again: no threads, no pinned CPUs)."""
    tier = FastTier(settings, store, cache, device, kernels, fallbacks, top_k, act_limit, ram_tier=ram_tier)
    worthwhile, why = tier.worthwhile()
    if settings.ct_enable == "auto" and not worthwhile:
        tier.close()
        off = f"the measured costs give it no share of the misses: {why}"
        log.info("CPU tier off (GLM53_CT_ENABLE=auto): %s; decode runs as in exact mode", off)
        return None, off
    log.info("CPU tier on (GLM53_CT_ENABLE=%s): %s", settings.ct_enable, why)
    return tier, None
