"""glm53.cpu_tier.controller on the CPU, built directly and fed counters: when the tier rests, probes and comes back,
how the probes space out, how a refresh reads its window (live figures apart from the eased model, late and
starved windows), when the split table is rebuilt, and whether taking part pays for the hooks (Worth)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from glm53.cpu_tier.controller import Controller, Counters, State, Worth
from glm53.cpu_tier.split import Costs, every_miss_to_the_cpu
from glm53.cpu_tier.tuning import Tuning

TUNING = Tuning()
PROBE_STEPS = TUNING.probe_steps


def counters(**values) -> Counters:
    return Counters(**{"jobs": 0, "experts": 0, "tokens": 0, "busy_s": 0.0, "published": 0, "done": 0, "late": 0,
                       "unclaimed": 0, **values})


class Feed:
    """The counters a controller's refreshes read, and the steps they were read at."""

    def __init__(self, controller: Controller):
        self.controller, self.now, self.read_at = controller, counters(), []

    def __call__(self) -> Counters:
        self.read_at.append(self.controller.steps)
        return self.now


def controller(costs: Costs, max_experts: int = 64, tuning: Tuning = TUNING) -> tuple[Controller, Feed]:
    c = Controller(costs, max_experts, counters(), tuning)
    return c, Feed(c)


def slow(link_s: float = 200e-6) -> Costs:
    """A CPU no table sends anything (20 ms an expert against the link's ``link_s``)."""
    return Costs({1: 20e-3}, 0.0, link_s, 1e-6, cpu_job_s={1: 0.0}, gpu_fixed_s=100e-6, sources={"cpu_expert_s": "raised"})


def probes(c: Controller, feed: Feed, steps: int) -> list[int]:
    """The steps (numbered from 1) that are probe steps over the next ``steps`` steps."""
    out = []
    for i in range(1, steps + 1):
        if c.state is State.PROBING:
            out.append(i)
        c.end_step(feed)
    return out


def test_a_table_that_sends_nothing_rests_the_tier_and_one_step_in_probe_steps_probes_then_refreshes():
    c, feed = controller(slow())
    assert c.cpu_off and c.state is State.RESTING and not c.launches
    for _ in range(PROBE_STEPS - 1):
        c.end_step(feed)
        assert c.state is State.RESTING
    c.end_step(feed)
    assert c.state is State.PROBING and c.launches and c.sampling  # a probe step is timed too
    c.end_step(feed)
    assert c.state is State.REFRESHING and not c.launches and feed.read_at == []
    c.end_step(feed)
    assert c.state is State.RESTING and feed.read_at == [PROBE_STEPS + 2]  # refreshed from the probe's jobs
    c.use_costs(Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6))  # the table sends the CPU experts again
    assert c.state is State.RUNNING and c.launches


def test_resting_probes_space_out_while_they_lower_nothing_and_only_they_refresh_the_costs():
    """A probe step costs the decode a few milliseconds: while probes find the host no faster, each interval is
    twice the one before, up to probe_steps_max; between probes nothing is refreshed (a refresh is host time
    between two steps)."""
    c, feed = controller(slow())
    found = probes(c, feed, 2000)
    gaps = [b - a - 1 for a, b in zip(found, found[1:])]  # a probe's refresh step counts towards the next
    assert gaps[:4] == [2 * PROBE_STEPS, 4 * PROBE_STEPS, 8 * PROBE_STEPS, 16 * PROBE_STEPS]
    assert max(gaps) == TUNING.probe_steps_max and gaps[-1] == TUNING.probe_steps_max
    assert feed.read_at == [p + 1 for p in found if p + 1 <= 2000]  # the step after each probe, and no other


def test_running_the_costs_are_refreshed_every_refresh_steps_and_the_next_step_is_timed_every_sample_steps():
    c, feed = controller(Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6), tuning=replace(TUNING, refresh_steps=4, sample_steps=3))
    sampled = []
    for _ in range(12):
        c.end_step(feed)
        sampled.append(c.sampling)
    assert feed.read_at == [4, 8, 12] and c.state is State.RUNNING
    assert [i + 1 for i, s in enumerate(sampled) if s] == [3, 6, 9, 12]


def probe_with(c: Controller, feed: Feed, cpu_s: float, jobs: int = 8, unclaimed: int = 0) -> None:
    """Run to the next probe and its refresh, whose window's jobs took ``cpu_s`` an expert (one expert, one token
    each); ``unclaimed`` more were published and taken back before the worker claimed them."""
    while c.state is not State.PROBING:
        c.end_step(feed)
    c.end_step(feed)  # the probe step
    now = feed.now
    feed.now = replace(now, jobs=now.jobs + jobs, experts=now.experts + jobs, tokens=now.tokens + jobs,
                       busy_s=now.busy_s + jobs * cpu_s, published=now.published + jobs + unclaimed, done=now.done + jobs,
                       unclaimed=now.unclaimed + unclaimed)
    c.end_step(feed)  # its refresh


def test_a_probe_that_finds_the_host_near_paying_keeps_the_next_one_close_and_one_that_pays_brings_it_back():
    """A probe's live figures, taken outright, decide the next interval: a host whose tier would save at least
    probe_near of its hooks' cost is probed again soon; one that is faster but still far from paying is not."""
    c, feed = controller(slow(), max_experts=16)
    for _ in range(64):
        c.worth.sampled(1, 2, 6)  # layers of one token: 2 hits, 6 misses
    c.worth.hook_s = 100e-6
    probes(c, feed, 100)  # no live figures: spaced out
    assert c._probe_every > PROBE_STEPS
    # a CPU expert at 6.4x the link's time: the split still sends one (all six on the GPU: 1,302 us; five and one on
    # the CPU: 1,280 us), saving 22 us a layer, under half the hooks' 100 us
    probe_with(c, feed, 1280e-6)
    assert c.probe_live.cpu_expert_s[1] == pytest.approx(1280e-6) and c.costs.cpu_expert_s[1] == pytest.approx(1280e-6)
    assert c.worth.saving_s == pytest.approx(22e-6) and c.state is State.RESTING and c._probe_every > PROBE_STEPS
    # 80 us saved: over half the hooks' cost, under the 125 us that would bring it back
    probe_with(c, feed, 1222e-6)
    assert c.worth.saving_s == pytest.approx(80e-6) and c.state is State.RESTING
    assert c._probe_every == PROBE_STEPS and c._until_probe == PROBE_STEPS - 1
    # a CPU as fast as the link: half the misses go to it, saving 600 us a layer: running again
    probe_with(c, feed, 200e-6)
    assert c.state is State.RUNNING and c.worth.saving_s == pytest.approx(600e-6)


def test_starved_probes_leave_no_live_figures_and_space_out_again():
    c, feed = controller(slow(), max_experts=16)
    for _ in range(64):
        c.worth.sampled(1, 2, 6)
    c.worth.hook_s = 100e-6
    probe_with(c, feed, 1222e-6)
    assert c.state is State.RESTING and c._probe_every == PROBE_STEPS  # near paying (80 us of 100)
    probe_with(c, feed, 1222e-6, unclaimed=4)  # 4 of 12 never claimed
    every = PROBE_STEPS
    assert c.probe_live is None and "starved" in c.costs.sources["cpu_expert_s"] and c._probe_every == 2 * every


def test_the_live_figures_of_a_refresh_are_kept_apart_from_the_eased_model():
    c, _ = controller(Costs({1: 400e-6}, 0.0, 200e-6, 1e-6, sources={"cpu_expert_s": "timed"}))
    assert c.state is State.RUNNING
    c.refresh(counters(jobs=10, experts=20, tokens=10, busy_s=20 * 100e-6))  # 100 us an expert, live
    assert c.probe_live.cpu_expert_s[1] == pytest.approx(100e-6)  # outright
    assert c.costs.cpu_expert_s[1] == pytest.approx(400e-6 / Costs.EASE)  # the model eases down by at most 1.25x
    c.refresh(counters(jobs=20, experts=40, tokens=20, busy_s=40 * 100e-6, published=10, late=5))  # half came late
    assert c.probe_live is None


def test_resting_a_probes_figures_are_taken_as_they_are():
    """A resting tier's windows hold only probes, shadow jobs published to time the host: their figures replace the
    model at once (a host freed after a burst is used again within a probe, not a dozen easing refreshes)."""
    c, _ = controller(Costs({1: 20e-3}, 0.0, 200e-6, 1e-6, sources={"cpu_expert_s": "raised"}))
    assert c.resting  # a 20 ms expert never pays against 200 us links, even for 64 misses
    c.refresh(counters(jobs=4, experts=8, tokens=4, busy_s=8 * 100e-6))  # the probes: 100 us an expert
    assert c.costs.cpu_expert_s[1] == pytest.approx(100e-6) and not c.resting


def test_a_refresh_that_moves_the_costs_a_little_keeps_the_table():
    c, _ = controller(Costs({1: 100e-6}, 0.0, 190e-6, 0.0, sources={"cpu_expert_s": "timed"}))
    table = c.table
    c.adopt(c.costs.slower(1.02))
    assert c.costs.cpu_expert_s[1] == pytest.approx(102e-6) and c.table is table  # the model moved, the table not
    c.adopt(c.costs.slower(1.02))  # 4 % from the table's figures in all
    assert c.table is not table and np.array_equal(c.table, c.costs.table(8, 64))  # rebuilt
    c.adopt(c.costs.slower(2.0))  # a busy host: a table that sends the CPU less
    assert int(c.table[1, 0, 4]) < int(table[1, 0, 4])


def test_a_retuned_controller_follows_its_new_tuning_from_the_next_step():
    c, feed = controller(Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6))
    never = 1 << 40
    c.retune(replace(TUNING, refresh_steps=never, sample_steps=never, hook_cost="gpu"))
    for _ in range(3 * PROBE_STEPS):
        c.end_step(feed)
    assert feed.read_at == [] and not c.sampling and c.worth.stats()["hook_cost"] == "gpu"


def test_the_tier_rests_while_its_split_saves_less_than_its_hooks_cost_and_comes_back_when_it_saves_more():
    costs = Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})
    table = costs.table(8, 64)
    w = Worth(TUNING)
    assert not w.decide(costs, table) and not w.resting  # nothing measured yet
    for _ in range(10):
        w.sampled(1, 0, 1)  # one miss a layer: the split saves 90 us (200 us on the link against 110 on the CPU)
        w.hooked(100e-6)
    assert w.decide(costs, table) and w.resting
    assert w.saving_s == pytest.approx(90e-6) and w.hook_s == pytest.approx(100e-6)
    w.hooked(80e-6)  # cheaper hooks: 90 > 80, but not hook_margin (1.25) x 80
    assert not w.decide(costs, table) and w.resting
    for _ in range(10):
        w.sampled(1, 0, 10)  # ten misses a layer: 1,290 us saved (7 on the CPU)
    assert w.decide(costs, table) and not w.resting and w.saving_s == pytest.approx((90e-6 + 1290e-6) / 2)
    assert w.stats() == {"hooks_us_per_layer": 80.0, "hooks_gpu_us_per_layer": None, "saving_us_per_layer": 690.0,
                         "hook_cost": "host", "resting": False, "layers_sampled": 20}
    w.hooked(10.0)  # hooks dearer than any saving: it rests...
    assert w.decide(costs, table) and w.resting
    forced = every_miss_to_the_cpu(costs)  # ...but not under a check's costs, which must keep the CPU path running
    w.hooked(10.0)
    assert w.decide(forced, forced.table(8, 64)) and not w.resting
    w.hooked(10.0)
    assert not w.decide(forced, forced.table(8, 64)) and not w.resting


def test_worth_charges_the_hooks_their_gpu_time_under_hook_cost_gpu():
    costs = Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})
    table = costs.table(8, 64)
    w = Worth(TUNING)
    for _ in range(10):
        w.sampled(1, 0, 1)  # the split saves 90 us a layer
        w.hooked(100e-6)  # 100 us of host time
        w.gpu_hooked(40e-6)  # 40 on the GPU's clock
    assert w.decide(costs, table) and w.resting and w.hook_cost_s() == pytest.approx(100e-6)  # "host": it rests
    w.tuning = replace(TUNING, hook_cost="gpu")
    w.hooked(100e-6)
    assert w.hook_cost_s() == pytest.approx(40e-6)
    assert w.decide(costs, table) and not w.resting  # 90 us saved against 1.25 x 40: it takes part
    assert w.stats()["hook_cost"] == "gpu" and w.stats()["hooks_gpu_us_per_layer"] == 40.0
    fresh = Worth(replace(TUNING, hook_cost="gpu"))  # no layer timed on the GPU yet: the host's figure stands in
    fresh.hooked(100e-6)
    fresh.sampled(1, 0, 1)
    assert fresh.hook_cost_s() is None  # no window closed yet
    assert fresh.decide(costs, table) and fresh.resting and fresh.hook_cost_s() == pytest.approx(100e-6)


def test_with_the_hooks_weighed_at_nothing_the_tier_rests_only_when_its_split_saves_nothing():
    costs = Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})
    table = costs.table(8, 64)
    w = Worth(replace(TUNING, hook_weight=0.0))  # bench.fast_ablation's no-rest run
    for _ in range(10):
        w.sampled(1, 0, 1)  # the split saves 90 us a layer
        w.hooked(10.0)  # hooks dearer than any saving
    assert not w.decide(costs, table) and not w.resting
    w.hooked(10.0)
    nothing = Costs({1: 1.0}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})  # a CPU too slow for any share
    assert not w.decide(nothing, nothing.table(8, 64)) and not w.resting  # saves 0, which is not below 0 x the hooks
    # (a table that sends the CPU nothing rests the tier anyway: Controller.cpu_off)


@pytest.mark.parametrize("bad", [{"refresh_steps": 0}, {"probe_experts": 0}, {"slower": 0.5}, {"hook_cost": "wall"}])
def test_a_tuning_that_cannot_work_is_refused(bad):
    with pytest.raises(ValueError):
        Tuning(**bad)
