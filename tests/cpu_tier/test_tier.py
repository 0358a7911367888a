"""glm53.cpu_tier.tier's per-layer bookkeeping on the CPU, with stand-ins for the GPU pieces (the producer's
kernels, the expert cache, exllamav3's fused expert kernel): what it hands the split, the collection and the
GPU fallback, when it stays out of the way, how it follows the host's live rate (a busy host gets fewer or no
experts within a refresh, shadow jobs while it gets none). The tier itself runs on the GPU (tests/gpu/test_fast_tier.py)."""

from __future__ import annotations

import collections
import os
import threading
from typing import ClassVar

import pytest
import torch

from glm53.cpu_tier import tier as ft
from glm53.offload.link import Link
from glm53.cpu_tier.split import Costs, Window, every_miss_to_the_cpu
from glm53.cpu_tier.tier import (
    PROBE_EXPERTS,
    PROBE_STEPS,
    REFRESH_STEPS,
    FastTier,
    FeedingThread,
)

H = 256
DEVICE = {"published": 0, "busy": 0, "done": 0, "failed": 0, "taken_back_before_claim": 0, "taken_back_after_claim": 0,
          "wait_s": 0.0, "fallback_jobs": 0, "fallback_experts": 0, "probes": 0, "native_host_atomics": False}


class FakeProducer:
    def __init__(self):
        self.published, self.collected, self.planned = [], [], []
        self.next_info = torch.tensor([1, 2, 1, 1], dtype=torch.int32)  # hits, misses, CPU experts, picks
        self.counters = dict(DEVICE)

    def split_publish(self, row, sel, rw, y, slot_of, freq, cube, probe_k=0):
        self.published.append((row, sel.shape, y.shape, slot_of.tolist(), freq.tolist(), probe_k))
        return torch.tensor([len(self.published)]), self.next_info.clone(), torch.full((128,), -1, dtype=torch.int32)

    def collect(self, status, acc, timeout_s, info=None, per_expert_s=0.0, floor_s=0.0):
        self.collected.append((int(status), tuple(acc.shape), acc.data_ptr(), timeout_s, per_expert_s, floor_s))
        acc += 1.0  # stands in for the partial
        return torch.tensor([1], dtype=torch.int32)

    def fallback_plan(self, status, outcome, record, tokens, topk, num_experts):
        self.planned.append((int(status), int(outcome), tokens, topk, num_experts))
        return "count", "tokens", "weights"

    def stats(self):
        return dict(self.counters)


class FakeFallback:
    """exllamav3's fused expert kernel: records what it is given and adds 10 where it computes."""

    def __init__(self):
        self.calls = []

    def __call__(self, y, acc, count, token_sorted, weight_sorted):
        self.calls.append((y.data_ptr(), acc.data_ptr(), tuple(acc.shape), count, token_sorted, weight_sorted))
        acc += 10.0


def tier():
    t = object.__new__(FastTier)
    t.hidden, t.deadline_s, t.enabled, t.skipped, t._pending = H, 0.05, True, 0, None
    t.producer = FakeProducer()
    t.top_k, t.fallbacks = 8, [FakeFallback(), FakeFallback()]
    t.store = type("Store", (), {"num_experts": 3})()
    t.cpu_off, t._probing, t._seen_device = False, False, t.producer.stats()
    t.cache = type("Cache", (), {"slot_of": torch.tensor([[0, -1, -1], [-1, 1, -1]], dtype=torch.int32),
                                 "freq": torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]]),
                                 "link": Link(None, torch.device("cpu")), "state": None, "block_bytes": 768})()
    t.cube = torch.zeros((9, 65, 65), dtype=torch.uint8)
    t.sent = torch.zeros(4, dtype=torch.int64)
    t.costs = Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})
    t.worker = FakeWorker()
    t.setup_s, t.max_experts, t._steps, t._seen, t.codebook = 0.0, 64, 0, t.worker.counters(), "fma"
    t._probe_link_s, t._sampling, t._open_sample, t._step_samples = t.costs.link_expert_s, False, None, []
    t._gpu_samples = Window(ft.GPU_SAMPLES, 2)
    t._probe_every = t._until_probe = PROBE_STEPS
    t._probe_refresh, t._probe_live = False, None
    t._event = FakeEvent
    t.pool = type("Pool", (), {"threads": 3})()
    t.feeding = FakeFeeding()
    t.worth, t._hook_s, t._table = ft.Worth(), 0.0, t.cube.numpy()
    t._table_costs = t.costs
    t.hook_parts, t.hooked_layers = ft.np.zeros(len(ft.HOOK_PARTS)), 0
    return t


class FakeFeeding:
    rest = {0}
    confined = True

    def confine(self):
        self.confined = True

    def release(self):
        self.confined = False


class FakeEvent:
    """A CUDA event on a scripted clock: each record() reads the next time from ``FakeEvent.clock`` (seconds)."""

    clock: ClassVar[list[float]] = []

    def record(self):
        self.t = FakeEvent.clock.pop(0)

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0  # milliseconds, as CUDA's


class FakeWorker:
    def __init__(self):
        self.live = {"jobs": 0, "experts": 0, "tokens": 0, "busy_s": 0.0}
        self.woken = self.rested = 0

    def counters(self):
        return dict(self.live)

    def wake(self):
        self.woken += 1

    def rest(self):
        self.rested += 1

    def parked(self):
        return True


def routing(T=2, dtype=torch.float16):
    return (torch.zeros((T, 8), dtype=torch.int64), torch.full((T, 8), 0.1, dtype=dtype),
            torch.zeros((T, H), dtype=torch.float16))


def test_a_decode_step_is_split_then_its_partial_and_the_gpu_fallback_added_to_the_layers_fp32_routed_sum():
    t = tier()
    sel, rw, z = routing(T=2)
    t.on_routing(1, sel, rw, z)
    row, sel_shape, y_shape, slot_of, freq, probe_k = t.producer.published[0]
    assert (row, tuple(sel_shape), tuple(y_shape), probe_k) == (1, (2, 8), (2, H), 0)
    assert slot_of == [-1, 1, -1] and freq == [1.0, 2.0, 3.0]  # the layer's own row of the cache
    assert t.sent.tolist() == [1, 2, 1, 1]
    routed = torch.zeros((2, 1, H), dtype=torch.float32)  # exllamav3's eshape: [tokens, 1, hidden]
    assert t.on_routed_sum(0, routed) is routed and not t.producer.collected  # another layer's sum: untouched
    assert t.on_routed_sum(1, routed) is routed
    status, shape, ptr, timeout, per_expert, floor = t.producer.collected[0]
    # a stop-loss wait: the job's experts' link time (the producer's kernel multiplies by the experts sent)
    assert (status, shape, ptr, timeout, per_expert, floor) == (1, (2, H), routed.data_ptr(), 0.05, 2e-4, ft.STOP_LOSS_FLOOR_S)
    # then the fallback plan from the collection's outcome, and the layer's own fused kernel on the same sum
    assert t.producer.planned == [(1, 1, 2, 8, 3)]
    [(y_ptr, acc_ptr, acc_shape, *plan)] = t.fallbacks[1].calls
    assert (y_ptr, acc_ptr, acc_shape, plan) == (z.data_ptr(), routed.data_ptr(), (2, H), ["count", "tokens", "weights"])
    assert not t.fallbacks[0].calls and bool((routed == 11).all())
    assert t.on_routed_sum(1, routed) is routed and len(t.producer.collected) == 1  # collected once


def test_while_the_table_sends_the_cpu_nothing_one_step_in_probe_steps_publishes_shadow_jobs():
    t = tier()
    t.cpu_off = True
    for _ in range(PROBE_STEPS - 1):
        t.after_step()
        assert not t._probing
    t.after_step()
    assert t._probing
    # the probe step is a sampled step too (the GPU computes all its misses): before and after the split, at the sum
    FakeEvent.clock[:] = [1.0, 1.00002, 1.001]
    t.on_routing(0, *routing(T=1))
    assert t.producer.published[-1][-1] == PROBE_EXPERTS and t._pending is None  # a shadow job is never collected
    routed = torch.zeros((1, 1, H), dtype=torch.float32)
    t.on_routed_sum(0, routed)
    assert not t.producer.collected and not t.fallbacks[0].calls and bool((routed == 0).all())
    t.after_step()
    assert not t._probing
    published = len(t.producer.published)
    t.on_routing(0, *routing(T=1))  # no probe step: nothing is launched at all (the layer runs as in exact mode)
    assert len(t.producer.published) == published and t._pending is None
    t.cpu_off = False  # the table sends the CPU experts again: no more probes
    for _ in range(PROBE_STEPS):
        t.after_step()
        assert not t._probing


def test_the_worker_spins_through_steps_that_may_publish_jobs_and_rests_after_every_step():
    """A worker that naps misses a job published in its nap (the GPU's wait is shorter than a nap): it is woken
    before every step the table may send it jobs in, probe steps too, and told after each that the step is over.
    While the table sends the CPU nothing, it is left asleep."""
    t = tier()
    t.before_step()
    t.after_step()
    assert (t.worker.woken, t.worker.rested) == (1, 1)
    t.cpu_off = True
    woken = []
    for _ in range(4 * PROBE_STEPS):  # probes at steps 9 and 26 (the second interval doubled)
        probing, before = t._probing, t.worker.woken
        t.before_step()
        woken.append(t.worker.woken - before)
        assert woken[-1] == int(probing)
        t.after_step()
    assert sum(woken) == 2 and t.worker.rested == 1 + 4 * PROBE_STEPS  # woken for the two probe steps alone


def probe_steps(t, steps: int) -> list[int]:
    """The steps (numbered from 1) that are probe steps over the next ``steps`` steps."""
    out = []
    for i in range(1, steps + 1):
        if t._probing:
            out.append(i)
        t.after_step()
    return out


def test_resting_probes_space_out_while_they_lower_nothing_and_only_they_refresh_the_costs():
    """A probe step costs the decode a few milliseconds: while probes find the host no faster, each interval is
    twice the one before, up to PROBE_STEPS_MAX; between probes nothing is refreshed (a refresh is host time
    between two steps)."""
    t = tier()
    t.cpu_off = True
    refreshes = []
    t._refresh = lambda: refreshes.append(t._steps)
    probes = probe_steps(t, 2000)
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]  # a probe's refresh step counts towards the next
    assert gaps[:4] == [2 * PROBE_STEPS, 4 * PROBE_STEPS, 8 * PROBE_STEPS, 16 * PROBE_STEPS]
    assert max(gaps) == ft.PROBE_STEPS_MAX and gaps[-1] == ft.PROBE_STEPS_MAX
    assert refreshes == [p + 1 for p in probes if p + 1 <= 2000]  # the step after each probe, and no other


def test_a_probe_that_finds_the_host_near_paying_keeps_the_next_one_close():
    """A probe's live figures, taken outright, decide the next interval: a host whose tier would save at least
    PROBE_NEAR of its hooks' cost is probed again soon (the model's eased figure catches up); one that is faster
    but still far from paying (the model merely coming down from a raise) is not."""
    t = tier()
    t.cpu_off = True
    t.max_experts = 16
    for _ in range(64):
        t.worth.sampled(1, 2, 6)  # layers of one token: 2 hits, 6 misses
    t.worth.hook_s = 100e-6
    probe_steps(t, 100)  # no live figures: spaced out
    assert t._probe_every > PROBE_STEPS
    link, fixed = 200e-6, 100e-6

    def live(cpu_s):
        def refresh():
            t._probe_live = Costs({1: cpu_s}, 0.0, link, 1e-6, cpu_job_s={1: 0.0}, gpu_fixed_s=fixed, sources={"cpu_expert_s": "probe"})
        return refresh

    def probe_with(refresh):
        t._refresh = refresh
        while not t._probing:
            t.after_step()
        t.after_step()  # the probe step
        t.after_step()  # its refresh

    # a CPU expert at 6.4x the link's time: the split still sends one (all six on the GPU: 1,302 us; five and one on
    # the CPU: 1,280 us), saving 22 us a layer, under half the hooks' 100 us
    probe_with(live(1280e-6))
    saving = t.worth.predicted_saving(t._probe_live, t._probe_live.table(ft.MAX_TOKENS, t.max_experts))
    assert saving == pytest.approx(22e-6) and t._probe_every > PROBE_STEPS
    # a CPU as fast as the link: half the misses go to it, saving ~3 of its experts' link time a layer
    probe_with(live(link))
    assert t._probe_every == PROBE_STEPS and t._until_probe == PROBE_STEPS - 1
    # late or starved probes leave no live figures: spaced out again
    t._refresh = lambda: setattr(t, "_probe_live", None)
    probe_steps(t, 60)
    assert t._probe_every >= 4 * PROBE_STEPS


def test_the_live_figures_of_a_refresh_are_kept_apart_from_the_eased_model():
    t = tier()
    t.costs = Costs({1: 400e-6}, 0.0, 200e-6, 1e-6, sources={"cpu_expert_s": "timed"})
    t.use_costs(t.costs)
    t.worker.live = {"jobs": 10, "experts": 20, "tokens": 10, "busy_s": 20 * 100e-6}  # 100 us an expert, live
    t._refresh()
    assert t._probe_live.cpu_expert_s[1] == pytest.approx(100e-6)  # outright
    assert t.costs.cpu_expert_s[1] == pytest.approx(400e-6 / Costs.EASE)  # the model eases down by at most 1.25x
    t.worker.live = {k: 2 * v for k, v in t.worker.live.items()}
    t.producer.counters["fallback_jobs"] = 5  # half the window's jobs came late
    t._refresh()
    assert t._probe_live is None


def test_resting_a_probes_figures_are_taken_as_they_are():
    """A resting tier's windows hold only probes, shadow jobs published to time the host: their figures replace the
    model at once (a host freed after a burst is used again within a probe, not a dozen easing refreshes)."""
    t = tier()
    t.costs = Costs({1: 20e-3}, 0.0, 200e-6, 1e-6, sources={"cpu_expert_s": "raised"})  # raised by a burst
    t.use_costs(t.costs)
    assert t.resting  # a 20 ms expert never pays against 200 us links, even for 64 misses
    t.worker.live = {"jobs": 4, "experts": 8, "tokens": 4, "busy_s": 8 * 100e-6}  # the probes: 100 us an expert
    t._refresh()
    assert t.costs.cpu_expert_s[1] == pytest.approx(100e-6) and not t.resting


def test_a_refresh_that_moves_the_costs_a_little_keeps_the_table():
    t = tier()
    t.costs = Costs({1: 100e-6}, 0.0, 190e-6, 0.0, sources={"cpu_expert_s": "timed"})
    t.use_costs(t.costs)
    table = t.cube.clone()
    t.cube.fill_(7)  # a marker: a rebuild would overwrite it
    t._adopt(t.costs.slower(1.02))
    assert t.costs.cpu_expert_s[1] == pytest.approx(102e-6) and bool((t.cube == 7).all())  # the model moved, the table not
    t._adopt(t.costs.slower(1.02))  # 4 % from the table's figures in all
    assert torch.equal(t.cube, torch.from_numpy(t.costs.table(8, 64))) and t._table_costs is t.costs  # rebuilt
    t._adopt(t.costs.slower(2.0))  # a busy host: a table that sends the CPU less
    assert int(t.cube[1, 0, 4]) < int(table[1, 0, 4])


def test_the_tier_stays_out_of_steps_it_cannot_take_and_while_paused():
    t = tier()
    t.on_routing(0, *routing(T=9))  # more rows than a decode step
    t.on_routing(0, *routing(T=1, dtype=torch.float32))  # router weights exllamav3's fused kernels do not read
    assert t.skipped == 2 and not t.producer.published
    with t.paused():
        t.on_routing(0, *routing(T=1))
    assert t.enabled and not t.producer.published and t._pending is None


def test_a_routed_sum_that_is_not_fp32_fails_loudly():
    t = tier()
    t.on_routing(0, *routing(T=1))
    with pytest.raises(RuntimeError, match="fp32"):
        t.on_routed_sum(0, torch.zeros((1, 1, H), dtype=torch.float16))


def test_stats_report_the_split_the_fallbacks_and_the_parked_worker():
    t = tier()
    t.producer.counters.update(fallback_jobs=2, fallback_experts=3, taken_back_after_claim=2)
    stats = t.stats()
    assert stats["split"]["cpu_experts"] == 0 and stats["split"]["cpu_off"] is False
    assert stats["device"]["fallback_jobs"] == 2 and stats["device"]["fallback_experts"] == 3
    assert stats["costs"]["cpu_expert_us"] == {1: 100.0} and stats["worker"]["parked"] is True
    assert set(stats["worth"]["hook_parts_us_per_layer"]) == set(ft.HOOK_PARTS)
    assert stats["worth"]["hook_parts_us_per_layer"]["collect"] is None  # no layer taken part in yet
    t.on_routing(0, *routing(T=1))
    t.on_routed_sum(0, torch.zeros((1, 1, H), dtype=torch.float32))
    parts = t.stats()["worth"]["hook_parts_us_per_layer"]
    assert t.hooked_layers == 1 and all(v >= 0 for v in parts.values())


def test_the_cost_table_follows_the_workers_live_timings_within_a_refresh():
    t = tier()
    t.costs = Costs({1: 100e-6}, 0.0, 190e-6, 0.0, sources={"cpu_expert_s": "timed"})
    t.cube = torch.from_numpy(t.costs.table(8, 64)).clone()
    before = t.cube.clone()
    assert int(before[1, 0, 4]) == 3  # at 100 us an expert the CPU takes 3 of 4 misses (190 us each on the link)
    # a busy host: 10 jobs of 1 token and 1 expert, 400 us each
    t.worker.live = {"jobs": 10, "experts": 10, "tokens": 10, "busy_s": 10 * 400e-6}
    for _ in range(REFRESH_STEPS - 1):
        t.after_step()
    assert torch.equal(t.cube, before)  # not yet
    t.after_step()
    assert t.costs.cpu_expert_s[1] == pytest.approx(400e-6)  # 4x off the model: taken at once, not averaged in
    assert "refreshed" in t.costs.sources["cpu_expert_s"]
    assert torch.equal(t.cube, torch.from_numpy(t.costs.table(8, 64))) and int(t.cube[1, 0, 4]) == 1
    # a measurement close to the model is averaged in
    t.worker.live = {"jobs": 20, "experts": 20, "tokens": 20, "busy_s": 10 * 400e-6 + 10 * 500e-6}
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert t.costs.cpu_expert_s[1] == pytest.approx(0.5 * 400e-6 + 0.5 * 500e-6)
    # no new jobs: nothing changes
    costs = t.costs
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert t.costs is costs


def test_jobs_the_worker_never_claimed_turn_the_cpu_off_until_shadow_jobs_time_it_again():
    t = tier()
    t.costs = Costs({1: 100e-6, 8: 300e-6}, 0.0, 190e-6, 0.0, sources={"cpu_expert_s": "timed"})
    t.use_costs(t.costs)
    assert not t.cpu_off
    t.producer.counters.update(published=10, taken_back_before_claim=1)  # one unclaimed job: a worker waking up
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert not t.cpu_off
    t.producer.counters.update(published=20, taken_back_before_claim=4)  # 3 of 10: a starved host
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert t.cpu_off and not t.cube.any() and "starved" in t.costs.sources["cpu_expert_s"]
    assert t.costs.cpu_expert_s[8] / t.costs.cpu_expert_s[1] == pytest.approx(3.0)  # ratios kept for the recovery
    # the shadow jobs of the probe steps show a free host again: 100 us an expert; the figures come down step by step
    busy = 0.0
    for window in range(1, 30):
        busy += 24 * 100e-6
        t.worker.live = {"jobs": 12 * window, "experts": 24 * window, "tokens": 12 * window, "busy_s": busy}
        for _ in range(REFRESH_STEPS):
            t.after_step()
        if not t.cpu_off:
            break
    assert window < 20, window  # within a few refreshes
    for window in range(window + 1, window + 30):
        busy += 24 * 100e-6
        t.worker.live = {"jobs": 12 * window, "experts": 24 * window, "tokens": 12 * window, "busy_s": busy}
        for _ in range(REFRESH_STEPS):
            t.after_step()
    assert t.costs.cpu_expert_s[1] == pytest.approx(100e-6, rel=0.01) and int(t.cube[1, 0, 4]) == 3
    assert t.costs.cpu_expert_s[8] == pytest.approx(300e-6, rel=0.01)


def test_late_jobs_double_what_the_worker_shows_without_compounding_and_clean_windows_bring_it_down_slowly():
    t = tier()
    t.costs = Costs({1: 100e-6}, 0.0, 190e-6, 0.0, sources={"cpu_expert_s": "timed"}, cpu_job_s={1: 50e-6})
    t.use_costs(t.costs)
    t.producer.counters.update(published=20, done=18, fallback_jobs=2)  # 2 of 20 late: over LATE_SHARE
    t.worker.live = {"jobs": 20, "experts": 20, "tokens": 20, "busy_s": 20 * 150e-6}  # the model's 150 us a job
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert t.costs.cpu_expert_s[1] == pytest.approx(200e-6) and t.costs.cpu_job_s[1] == pytest.approx(100e-6)
    assert "late" in t.costs.sources["cpu_expert_s"]
    t.producer.counters.update(published=40, done=36, fallback_jobs=4)  # late again, the worker as fast as before
    t.worker.live = {"jobs": 40, "experts": 40, "tokens": 40, "busy_s": 40 * 150e-6}
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert t.costs.cpu_expert_s[1] == pytest.approx(200e-6)  # twice what it shows, not twice the last model
    t.producer.counters.update(published=60, done=56)  # a clean window, the worker still at 150 us a job
    t.worker.live = {"jobs": 60, "experts": 60, "tokens": 60, "busy_s": 60 * 150e-6}
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert t.costs.cpu_expert_s[1] == pytest.approx(200e-6 / 1.25)
    assert t.costs.cpu_job_s[1] == pytest.approx(100e-6 / 1.25)  # the fixed part raised with it comes down with it


def test_the_gpu_part_of_sampled_steps_sets_the_link_and_fixed_costs():
    """One step in SAMPLE_STEPS has every layer's GPU part timed (between the split and the wait for the CPU); at
    the refresh a line through (GPU misses, seconds) replaces the start-up probe's link figure."""
    t = tier()
    t.costs = Costs({1: 400e-6}, 0.0, 184e-6, 0.0, sources={"cpu_expert_s": "timed"}, cpu_pinned=True)
    t.cube = torch.from_numpy(t.costs.table(8, 64)).clone()
    t._probe_link_s = 184e-6
    t.worth.hooked = lambda seconds: None  # the fakes' host time must not make the tier rest (Worth's own test)
    x = torch.zeros((1, H), dtype=torch.float32)
    timed = 0
    steps = 8 * ft.SAMPLE_STEPS  # enough sampled layers for a line (fit_gpu_line's minimum)
    assert steps % REFRESH_STEPS == 0
    for step in range(1, steps + 1):
        if t._sampling:
            for row, gpu_misses in ((0, 2), (1, 5)) * 6:  # 12 layers; the fake split sends no expert to the CPU
                t.producer.next_info = torch.tensor([1, gpu_misses, 0, 0], dtype=torch.int32)
                own = 75e-6 + gpu_misses * 198e-6  # between the split and the collect: the GPU's own part
                FakeEvent.clock[:] = [1.0 - 20e-6, 1.0, 1.0 + own, 1.0 + own + 30e-6]
                t.on_routing(row, *routing(T=1))
                t.on_routed_sum(row, x)
                timed += 1
        t.after_step()
    assert timed == 12 * (steps // ft.SAMPLE_STEPS - 1)  # the last sampled step's layers run after the refresh
    assert t.costs.link_expert_s == pytest.approx(198e-6) and t.costs.gpu_fixed_s == pytest.approx(75e-6)
    assert "live" in t.costs.sources["link_expert_s"] and t.stats()["costs"]["gpu_fixed_us"] == 75.0
    assert torch.equal(t.cube, torch.from_numpy(t.costs.table(8, 64)))
    # the same layers sent the CPU nothing: 20 us in the split and 30 from the collect to the fallback's launch
    assert t.worth.hook_gpu_s == pytest.approx(50e-6) and t.stats()["worth"]["hooks_gpu_us_per_layer"] == 50.0


def test_worth_charges_the_hooks_their_gpu_time_under_hook_cost_gpu(monkeypatch):
    costs = Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})
    table = costs.table(8, 64)
    w = ft.Worth()
    for _ in range(10):
        w.sampled(1, 0, 1)  # the split saves 90 us a layer
        w.hooked(100e-6)  # 100 us of host time
        w.gpu_hooked(40e-6)  # 40 on the GPU's clock
    assert w.decide(costs, table) and w.resting and w.hook_cost_s() == pytest.approx(100e-6)  # "host": it rests
    monkeypatch.setattr(ft, "HOOK_COST", "gpu")
    w.hooked(100e-6)
    assert w.hook_cost_s() == pytest.approx(40e-6)
    assert w.decide(costs, table) and not w.resting  # 90 us saved against 1.25 x 40: it takes part
    assert w.stats()["hook_cost"] == "gpu" and w.stats()["hooks_gpu_us_per_layer"] == 40.0
    fresh = ft.Worth()  # no layer timed on the GPU yet: the host's figure stands in
    fresh.hooked(100e-6)
    fresh.sampled(1, 0, 1)
    assert fresh.hook_cost_s() is None  # no window closed yet
    assert fresh.decide(costs, table) and fresh.resting and fresh.hook_cost_s() == pytest.approx(100e-6)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_feeding_thread_keeps_off_the_tiers_cpus_while_it_runs():
    allowed = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    seen = {}

    def report(name):
        seen[name] = os.sched_getaffinity(0)

    def in_a_thread():  # the engine's thread; the test's own is left as it was
        feeding = FeedingThread(tuple(allowed[1:]))
        feeding.confine()
        report("confined")
        seen["torch threads"] = torch.get_num_threads()
        t = threading.Thread(target=report, args=("started after",))
        t.start()
        t.join()
        feeding.release()
        report("released")
        everything = FeedingThread(tuple(allowed))  # the tier takes every CPU: nothing moves
        everything.confine()
        report("tier takes all")
        seen["confined with nowhere to go"] = everything.confined  # after_step asks again only when it is not

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert seen["confined"] == seen["started after"] == {allowed[0]} and seen["torch threads"] == 1
    assert seen["released"] == seen["tier takes all"] == set(allowed) and seen["confined with nowhere to go"]
    assert torch.get_num_threads() == threads and os.sched_getaffinity(0) == set(allowed)


def test_a_failed_start_stops_what_started_and_gives_the_cpus_back(monkeypatch):
    import glm53.cpu_tier.tier as ft

    stopped = []

    class Started:
        def __init__(self, name):
            self.name = name

        def start(self):
            return self

        def stop(self):
            stopped.append(self.name)

    feeding = []
    monkeypatch.setattr(ft, "FeedingThread", lambda cpus: type("F", (), {
        "confine": lambda self: feeding.append("confine"), "release": lambda self: feeding.append("release")})())
    pool = Started("pool")
    pool.cpus = (2, 3)
    monkeypatch.setattr(ft.ce.Pool, "for_caller", classmethod(lambda cls, settings, spin_us: (pool, 1)))
    monkeypatch.setattr(ft, "Ring", lambda *a: object())
    monkeypatch.setattr(ft, "Worker", lambda *a, **k: Started("worker"))
    monkeypatch.setattr(ft, "ExpertTable", lambda *a: object())
    monkeypatch.setattr(ft, "host_store_experts", lambda *a: {})

    def no_gpu(*a):
        raise RuntimeError("cudaHostRegister failed")

    monkeypatch.setattr(ft, "DeviceProducer", no_gpu)
    monkeypatch.setattr(ft, "CtKernels", lambda path: None)
    store = type("Store", (), {"layout": type("L", (), {"shapes": [(16, 8)]})(), "num_layers": 1, "num_experts": 4,
                               "read_sign_scale": lambda self, d: {}})()
    settings = type("S", (), {"ct_cpus": "auto", "ct_threads": 0, "ct_codebook": "fma", "model_dir": None})()
    kernels = type("Kernels", (), {"path": None})()
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        FastTier(settings, store, None, torch.device("cpu"), kernels, [None], top_k=2, act_limit=0.0)
    assert stopped == ["worker", "pool"] and feeding == ["confine", "release"]


@pytest.mark.parametrize("enable, worthwhile, on", [("auto", False, False), ("auto", True, True), (True, False, True)])
def test_start_leaves_the_tier_off_only_under_auto_when_the_costs_give_it_nothing(monkeypatch, enable, worthwhile, on):
    closed = []

    class Tier:
        def __init__(self, *args):
            self.args = args

        def worthwhile(self):
            return worthwhile, "a one-expert CPU job costs more"

        def close(self):
            closed.append(self)

    monkeypatch.setattr(ft, "FastTier", Tier)
    settings = type("S", (), {"ct_enable": enable})()
    tier, off = ft.start(settings, "store", "cache", "device", "kernels", ["fallback"], 8, 7.0)
    if on:
        assert isinstance(tier, Tier) and off is None and not closed
        assert tier.args == (settings, "store", "cache", "device", "kernels", ["fallback"], 8, 7.0)
    else:
        assert tier is None and len(closed) == 1
        assert off == "the measured costs give it no share of the misses: a one-expert CPU job costs more"


def test_the_tier_rests_while_its_split_saves_less_than_its_hooks_cost_and_comes_back_when_it_saves_more():
    costs = Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})
    table = costs.table(8, 64)
    w = ft.Worth()
    assert not w.decide(costs, table) and not w.resting  # nothing measured yet
    for _ in range(10):
        w.sampled(1, 0, 1)  # one miss a layer: the split saves 90 us (200 us on the link against 110 on the CPU)
        w.hooked(100e-6)
    assert w.decide(costs, table) and w.resting
    assert w.saving_s == pytest.approx(90e-6) and w.hook_s == pytest.approx(100e-6)
    w.hooked(80e-6)  # cheaper hooks: 90 > 80, but not HOOK_MARGIN (1.25) x 80
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


def test_with_the_hooks_weighed_at_nothing_the_tier_rests_only_when_its_split_saves_nothing(monkeypatch):
    costs = Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})
    table = costs.table(8, 64)
    monkeypatch.setattr(ft, "HOOK_WEIGHT", 0.0)  # bench.fast_ablation's no-rest run
    w = ft.Worth()
    for _ in range(10):
        w.sampled(1, 0, 1)  # the split saves 90 us a layer
        w.hooked(10.0)  # hooks dearer than any saving
    assert not w.decide(costs, table) and not w.resting
    w.hooked(10.0)
    nothing = Costs({1: 1.0}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})  # a CPU too slow for any share
    assert not w.decide(nothing, nothing.table(8, 64)) and not w.resting  # saves 0, which is not below 0 x the hooks
    # (a table that sends the CPU nothing rests the tier anyway: FastTier.cpu_off)


def test_a_resting_tier_launches_nothing_but_probes_and_gives_the_feeding_thread_its_cpus_back():
    t = tier()
    t.cube[1, 0, 1] = 1  # the table would send the CPU a miss
    t.on_routing(0, *routing(T=1))
    t.on_routed_sum(0, torch.zeros((1, 1, H), dtype=torch.float32))
    assert len(t.producer.published) == 1 and t.worth._layers == 1 and t.worth._sum > 0  # the hooks' host time
    t.worth.resting = True
    t.on_routing(0, *routing(T=1))
    assert len(t.producer.published) == 1 and t._pending is None
    t.before_step()
    assert t.worker.woken == 0
    t.after_step()
    assert not t.feeding.confined and not t._probing
    for _ in range(PROBE_STEPS - 1):
        t.after_step()
    assert t._probing
    t.before_step()
    assert t.worker.woken == 1
    FakeEvent.clock[:] = [1.0, 1.001]
    t.on_routing(0, *routing(T=1))
    assert t.producer.published[-1][-1] == PROBE_EXPERTS
    t.worth.resting = False
    t.after_step()
    assert t.feeding.confined and not t._probing
