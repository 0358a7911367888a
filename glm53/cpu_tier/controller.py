"""How the CPU tier follows the host's live rate, between two decode steps (on the thread feeding the GPU, after the
step's synchronisation): a state machine fed the worker's and the device's counters and the timed layers' figures,
which holds the costs and the split table the device reads. NumPy only: it is tested on the CPU without a tier.

States (:class:`State`):

- RUNNING: the tier takes part in every layer; the costs are refreshed every ``refresh_steps`` steps from the
  window since the last refresh: late jobs (more than ``late_share`` of the window's: the CPU figures become
  ``slower`` times what the window's busy time shows, never compounding; they come down again slowly), the worker's
  busy time per expert (a slower host is seen within a refresh), jobs the worker never claimed (a starved host: its
  CPU figures rise until the table sends nothing), and the GPU's own time for its part of every layer of one step in
  ``sample_steps`` (a line through misses and seconds, ``split.fit_gpu_line``). The table is rebuilt only when its
  figures moved by more than ``table_drift``.
- RESTING: the table sends the CPU nothing, or its saving does not pay for its hooks (:class:`Worth`): nothing is
  launched (as in exact mode) but for probe steps, the first ``probe_steps`` steps after the rest began.
- PROBING: resting, this step publishes shadow jobs (the GPU computes those experts as well) whose busy time tells
  when the host has become fast enough again.
- REFRESHING: resting, the step after a probe: at its end the costs are refreshed from the probe's jobs alone, taken
  as they are. The next probe comes ``probe_steps`` later if the probe's figures, taken outright, would have the
  split save ``probe_near`` of its hooks' cost, else twice the last interval, up to ``probe_steps_max`` (measured on
  the H200 host: probes one step in 8 and a refresh every 8 steps took 11 % off a resting tier's decode; a rule that
  kept the interval short while the model's CPU figure came down step by step from a raise still took 3-8 %;
  bench/fast_ablation.py). Only a host that is near paying is probed often: then its model catches up with the
  live figure within a few probes.

A refresh is kept to a few hundred microseconds: closed forms over preallocated windows.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from ..cost_model import MAX_TOKENS, Costs
from .split import Window, fit_gpu_line
from .tuning import Tuning

log = logging.getLogger(__name__)

GPU_SAMPLES = 768  # the latest timed layers the GPU's line is fitted to
LAYER_SAMPLES = 768  # the latest sampled layers' (tokens, hits, misses) the split's saving is predicted over


class State(enum.Enum):
    RUNNING = "running"
    RESTING = "resting"
    PROBING = "probing"
    REFRESHING = "refreshing"


@dataclass(frozen=True)
class Counters:
    """The running totals a refresh takes its window from: the worker's and the device producer's."""

    jobs: int
    experts: int
    tokens: int
    busy_s: float
    published: int
    done: int
    late: int  # jobs computed on the GPU after all (the device's fallback_jobs)
    unclaimed: int  # jobs taken back before the worker claimed them

    @classmethod
    def read(cls, worker: Mapping, device: Mapping) -> Counters:
        """From ``Worker.counters()`` and ``DeviceProducer.stats()``."""
        return cls(worker["jobs"], worker["experts"], worker["tokens"], worker["busy_s"], device["published"],
                   device["done"], device["fallback_jobs"], device["taken_back_before_claim"])


class Worth:
    """Whether taking part in decode pays for the tier's hooks. On every layer it takes part in, the thread feeding
    the GPU spends host time launching the split, the collect and the GPU fallback (a decode step of a small batch
    is bound by that thread's launches: on the H200 host, a tier that took under 1 % of the misses made the step
    6 % slower than exact mode's, about 90 us a layer), a cost the split's table does not see. So the table's
    predicted saving of a layer, averaged over sampled layers (their tokens, hits and misses, the table's ``k``),
    is set against the hooks' measured cost per layer (times ``hook_weight``): below it the tier RESTS; it comes
    back once the saving is ``hook_margin`` times the hooks' cost. Never with a check's forced costs
    (``split.every_miss_to_the_cpu``). The hooks' cost is their host time, or with ``hook_cost`` "gpu" their time on
    the GPU's clock in sampled layers (the split table's currency: host time costs the step nothing while the
    feeding thread runs ahead of the GPU, which it did by ~10 ms a step on the H200 host)."""

    def __init__(self, tuning: Tuning):
        self.tuning = tuning
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
        """What the hooks cost a layer, in ``hook_cost``'s currency (the GPU's, before any layer was timed: the host's)."""
        gpu = self.hook_gpu_s if self.tuning.hook_cost == "gpu" else None
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
        self.resting = self.saving_s < self.tuning.hook_weight * cost * (self.tuning.hook_margin if self.resting else 1.0)
        return self.resting != before

    def stats(self) -> dict:
        us = {k: None if v is None else round(v * 1e6, 1) for k, v in (("hooks_us_per_layer", self.hook_s),
                                                                       ("hooks_gpu_us_per_layer", self.hook_gpu_s),
                                                                       ("saving_us_per_layer", self.saving_s))}
        return {**us, "hook_cost": self.tuning.hook_cost, "resting": self.resting, "layers_sampled": len(self.samples)}


class Controller:
    """The tier's costs, split table and state, moved between steps by :meth:`end_step`.

    :param costs: the start-up measurement (``measure.measure_costs``). :param max_experts: the split table's size.
    :param counters: the worker's and device's totals at start (the first window's beginning).
    """

    def __init__(self, costs: Costs, max_experts: int, counters: Counters, tuning: Tuning | None = None):
        self.tuning = tuning or Tuning()
        self.max_experts = max_experts
        self.worth = Worth(self.tuning)
        self.steps = 0
        self._seen = counters
        self._cycle: State | None = None  # resting: PROBING (this step probes) or REFRESHING (the step after a probe)
        self._probe_every = self.tuning.probe_steps  # resting: steps between probes (doubling while probes lower nothing)
        self._until_probe = self.tuning.probe_steps  # resting: steps left before the next probe
        self.probe_live: Costs | None = None  # the last refresh's live CPU figures taken outright (None: late, starved, no jobs)
        self.probe_link_s = costs.link_expert_s  # the start-up probe's figure, a live line's sanity range
        self.gpu_samples = Window(GPU_SAMPLES, 2)  # (GPU misses, seconds) of timed layers
        self.sampling = False  # this step's layers are timed
        self._rebuilt = False
        self.use_costs(costs)

    # ---- what the per-layer hooks read

    @property
    def state(self) -> State:
        """The tier launches jobs in RUNNING and PROBING steps only (:attr:`launches`)."""
        if self._cycle is State.PROBING:
            return State.PROBING
        if not self.resting:  # costs set from outside (a check's, a new link) may end a rest at any step
            return State.RUNNING
        return self._cycle or State.RESTING

    @property
    def resting(self) -> bool:
        """The tier launches nothing but probes: its table sends the CPU nothing, or its saving is below its hooks'
        cost (:class:`Worth`)."""
        return self.cpu_off or self.worth.resting

    @property
    def probing(self) -> bool:
        return self._cycle is State.PROBING

    @property
    def launches(self) -> bool:
        """This step's layers publish jobs: the tier runs, or this is a probe step."""
        return self._cycle is State.PROBING or not self.resting

    # ---- costs

    def use_costs(self, costs: Costs) -> None:
        """Split by these costs from the next step on (``table``: the caller copies it to the device)."""
        self.costs = self._table_costs = costs
        self.table = costs.table(MAX_TOKENS, self.max_experts)
        self.cpu_off = not self.table.any()  # the table sends the CPU nothing: probe now and then
        self._rebuilt = True

    def adopt(self, costs: Costs) -> None:
        """A refresh's costs: kept as the model, the table rebuilt only past ``table_drift`` (or when the CPU's
        share may change sign: the table sends it nothing, or the new figures are a check's)."""
        if self.cpu_off or costs.forced or costs.table_drift(self._table_costs, MAX_TOKENS) > self.tuning.table_drift:
            self.use_costs(costs)
        else:
            self.costs = costs

    def relinked(self, costs: Costs) -> None:
        """The link changed under a running engine: ``costs`` carry its new figure (the GPU's line cleared); the live
        line and whether the split pays start over."""
        self.probe_link_s = costs.link_expert_s
        self.gpu_samples = Window(GPU_SAMPLES, 2)
        self.worth = Worth(self.tuning)
        self._probe_every = self._until_probe = self.tuning.probe_steps
        self.use_costs(costs)

    def retune(self, tuning: Tuning) -> None:
        """Follow ``tuning`` from the next step on (the state and windows are kept)."""
        self.tuning = self.worth.tuning = tuning

    # ---- between steps

    def sampled(self, tokens: int, hits: int, misses: int, cpu_experts: int, gpu_s: float, hook_gpu_s: float | None) -> None:
        """A timed layer of the step just synchronised: its split's counts, the GPU's seconds for its own part, and
        (a layer that sent the CPU nothing, collected) the hooks' own seconds on the GPU."""
        self.gpu_samples.append(misses - cpu_experts, gpu_s)
        self.worth.sampled(tokens, hits, misses)
        if hook_gpu_s is not None:
            self.worth.gpu_hooked(hook_gpu_s)

    def end_step(self, counters: Callable[[], Counters]) -> bool:
        """Once per engine step, after its synchronisation and its timed layers (:meth:`sampled`): running,
        refreshes the costs every ``refresh_steps`` steps; resting, arms the probes (their interval doubling while
        they lower nothing) and refreshes from each probe's jobs; arms the timing of the next step every
        ``sample_steps``. ``counters`` is read only when a refresh is due (it reads the device). Returns whether the
        split table changed (the caller copies :attr:`table` to the device)."""
        t = self.tuning
        self._rebuilt = False
        self.steps += 1
        cycle, self._cycle = self._cycle, None
        if cycle is State.REFRESHING:  # the step after a probe: its shadow jobs are in the worker's counters
            self.refresh(counters())
            if self.resting:
                near = self.near_paying(self.probe_live)
                self._probe_every = t.probe_steps if near else min(2 * self._probe_every, t.probe_steps_max)
                self._until_probe = self._probe_every
        elif not self.resting and self.steps % t.refresh_steps == 0:
            self.refresh(counters())
            if self.resting:  # it came to rest: the probes start over
                self._probe_every = self._until_probe = t.probe_steps
        if cycle is State.PROBING:
            self._cycle = State.REFRESHING
        elif self.resting:
            self._until_probe -= 1
            if self._until_probe <= 0:
                self._cycle, self._until_probe = State.PROBING, self._probe_every
        self.sampling = self._cycle is State.PROBING or self.steps % t.sample_steps == 0
        return self._rebuilt

    def near_paying(self, live: Costs | None) -> bool:
        """Whether these live figures, taken outright, would have the split save at least ``probe_near`` of the hooks'
        cost per layer (``Worth.hook_cost_s``) over the sampled layers (the hooks not yet timed: save anything; no
        layer sampled yet: send the CPU anything)."""
        if live is None:
            return False
        table = live.table(MAX_TOKENS, self.max_experts)
        saving = self.worth.predicted_saving(live, table)
        if saving is None:
            return bool(table.any())
        hook = self.worth.hook_cost_s()
        return saving > 0 and (hook is None or saving >= self.tuning.probe_near * hook)

    def refresh(self, now: Counters) -> None:
        """The costs from the window since the last refresh (``now``: the totals at its end)."""
        t, seen = self.tuning, self._seen
        jobs, experts = now.jobs - seen.jobs, now.experts - seen.experts
        busy, tokens = now.busy_s - seen.busy_s, now.tokens - seen.tokens
        unclaimed, published = now.unclaimed - seen.unclaimed, now.published - seen.published
        late = now.late - seen.late
        collected = late + now.done - seen.done
        self._seen = now
        fresh, self.probe_live = self.costs, None
        live = fresh.refreshed(busy, experts, -(-tokens // jobs), jobs, weight=1.0, ease=float("inf")) if jobs > 0 else None
        if late > max(1, t.late_share * collected):
            # the worker's busy time does not see all of what makes a job late (its threads preempted, its wake-ups):
            # the split sends fewer until the windows are clean again, at `slower` times what the window's busy time
            # shows (never compounding from window to window: a burst of late jobs does not outlast itself)
            fresh = (live or fresh).slower(t.slower)
        elif live is not None:
            self.probe_live = live
            # resting, the window's jobs were probes, shadow jobs published to time the host: taken as they are (a
            # wrong guess costs a few late jobs, which the GPU computes and the next window sees); running, averaged
            # in and lowered by at most Costs.EASE a refresh
            fresh = live if self.resting else fresh.refreshed(busy, experts, -(-tokens // jobs), jobs)
        if unclaimed > max(1, t.starved_share * published):
            self.probe_live = None
            # the worker did not even get to many of its jobs by their deadline: the host is starved (one such job
            # is a worker waking from a park; its experts were computed on the GPU anyway)
            fresh = fresh.starved()
        line = fit_gpu_line(*self.gpu_samples.columns(), self.probe_link_s)
        if line is not None:
            fresh = fresh.with_gpu_line(*line)
            self.probe_live = None if self.probe_live is None else self.probe_live.with_gpu_line(*line)
        if fresh is not self.costs:
            self.adopt(fresh)
        if self.worth.decide(self.costs, self.table):
            log.info("CPU tier %s: its split saves %.0f us a layer, its hooks cost %.0f us a layer (%s time)",
                     "resting" if self.worth.resting else "back", self.worth.saving_s * 1e6, self.worth.hook_cost_s() * 1e6,
                     "GPU" if t.hook_cost == "gpu" and self.worth.hook_gpu_s is not None else "host")


def relinked_costs(costs: Costs, link_expert_s: float, how: str) -> Costs:
    """``costs`` on a link timed again (``how``: the measurement, for /stats): its figure, the GPU's line cleared."""
    return replace(costs, link_expert_s=link_expert_s, gpu_fixed_s=0.0, sources={**costs.sources, "link_expert_s": how})
