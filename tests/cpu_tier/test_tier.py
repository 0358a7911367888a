"""glm53.cpu_tier.tier's per-layer hooks and step hooks on the CPU: a FastTier built by its own constructor over
stand-ins for the GPU pieces (the producer's kernels, the expert cache, exllamav3's fused expert kernel, the worker
and its pool, the start-up measurement): what it hands the split, the collection and the GPU fallback, when it stays
out of the way, how its controller's decisions reach the device's table and the worker. The controller alone is
tests/cpu_tier/test_controller.py; the tier itself runs on the GPU (tests/gpu/test_fast_tier.py)."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from typing import ClassVar

import numpy as np
import pytest
import torch

from glm53.cpu_tier import tier as ft
from glm53.cpu_tier.controller import State
from glm53.cpu_tier.split import Costs
from glm53.cpu_tier.tier import FastTier, FeedingThread
from glm53.cpu_tier.tuning import Tuning
from glm53.offload.link import Link

H = 256
TUNING = Tuning()
PROBE_STEPS, REFRESH_STEPS, SAMPLE_STEPS = TUNING.probe_steps, TUNING.refresh_steps, TUNING.sample_steps
COSTS = Costs({1: 1e-4}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})
SLOW = Costs({1: 1.0}, 1e-5, 2e-4, 1e-6, sources={"cpu_expert_s": "test"})  # a CPU the table sends nothing
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

    def close(self):
        pass


class FakeFallback:
    """exllamav3's fused expert kernel: records what it is given and adds 10 where it computes."""

    def __init__(self):
        self.calls = []

    def __call__(self, y, acc, count, token_sorted, weight_sorted):
        self.calls.append((y.data_ptr(), acc.data_ptr(), tuple(acc.shape), count, token_sorted, weight_sorted))
        acc += 10.0


class FakeFeeding:
    rest = {0}

    def __init__(self):
        self.confined = False

    def confine(self):
        self.confined = True

    def release(self):
        self.confined = False


class FakeArenaExperts:
    """``worker.ArenaExperts`` over a RAM tier stand-in: every expert at its home; trellises at 3 offsets."""

    def __init__(self, store, ram_tier, home_host, sign_scale):
        self.experts = {(row, e): ("linears", row, e) for row in range(store.num_layers) for e in range(store.num_experts)}

    def trellises(self, addresses):
        return np.asarray(addresses)[:, None] + np.array([0, 256, 512])[None, :]


class FakeRamTier:
    """A RAM tier stand-in: its policy slots and its disk reader's thread placement."""

    def __init__(self):
        self.policy = type("Policy", (), {"slot_of": np.array([[0, -1, -1], [-1, -1, -1]])})()
        self.reader = type("Reader", (), {"moves": [], "set_cpus": lambda self, cpus: self.moves.append(cpus)})()


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

    def start(self):
        return self

    def counters(self):
        return dict(self.live)

    def wake(self):
        self.woken += 1

    def rest(self):
        self.rested += 1

    def parked(self):
        return True

    def stop(self):
        pass


class FakePool:
    threads, cpus = 3, (2, 3)

    def start(self):
        return self

    def stop(self):
        pass


SETTINGS = type("Settings", (), {"ct_codebook": "fma", "model_dir": None, "ct_b": None, "ct_deadline_ms": 50.0})()
STORE = type("Store", (), {"layout": type("Layout", (), {"shapes": [(H // 16, 8)], "block_bytes": 768})(), "num_layers": 2,
                           "num_experts": 3, "read_sign_scale": lambda self, model_dir: {}})()


def cache():
    return type("Cache", (), {"slot_of": torch.tensor([[0, -1, -1], [-1, 1, -1]], dtype=torch.int32),
                              "freq": torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]]),
                              "link": Link(None, torch.device("cpu")), "state": None, "block_bytes": 768,
                              "home_host": np.zeros((2, 3), dtype=np.int64)})()


@pytest.fixture
def make_tier(monkeypatch):
    """``make_tier(costs, tuning)``: a FastTier started over stand-ins, its start-up measurement giving ``costs``."""

    def make(costs: Costs = COSTS, tuning: Tuning | None = None, ram_tier=None) -> FastTier:
        worker, producer, timed = FakeWorker(), FakeProducer(), []
        for name, value in [("FeedingThread", lambda cpus: FakeFeeding()), ("Ring", lambda *a: None),
                            ("Worker", lambda *a, **k: worker), ("ExpertTable", lambda *a: None),
                            ("host_store_experts", lambda *a: {}), ("DeviceProducer", lambda *a: producer),
                            ("ArenaExperts", FakeArenaExperts),
                            ("CtKernels", lambda path: None),
                            ("measure_costs", lambda experts, **kw: (timed.append(sorted(experts)), costs)[1])]:
            monkeypatch.setattr(ft, name, value)
        monkeypatch.setattr(ft.ce.Pool, "for_caller", classmethod(lambda cls, settings, spin_us: (FakePool(), 1)))
        t = FastTier(SETTINGS, STORE, cache(), torch.device("cpu"), type("Kernels", (), {"path": None})(),
                     [FakeFallback(), FakeFallback()], top_k=8, act_limit=0.0, tuning=tuning, ram_tier=ram_tier)
        t._event = FakeEvent
        t.timed_on = timed  # the experts the CPU's cost was timed on
        return t

    return make


def routing(T=2, dtype=torch.float16):
    return (torch.zeros((T, 8), dtype=torch.int64), torch.full((T, 8), 0.1, dtype=dtype),
            torch.zeros((T, H), dtype=torch.float16))


def test_a_decode_step_is_split_then_its_partial_and_the_gpu_fallback_added_to_the_layers_fp32_routed_sum(make_tier):
    t = make_tier()
    assert torch.equal(t.cube, torch.from_numpy(COSTS.table(8, 64)))  # the device's table, from the start's costs
    sel, rw, z = routing(T=2)
    t.routed(1, sel, rw, z)
    row, sel_shape, y_shape, slot_of, freq, probe_k = t.producer.published[0]
    assert (row, tuple(sel_shape), tuple(y_shape), probe_k) == (1, (2, 8), (2, H), 0)
    assert slot_of == [-1, 1, -1] and freq == [1.0, 2.0, 3.0]  # the layer's own row of the cache
    assert t.sent.tolist() == [1, 2, 1, 1]
    routed = torch.zeros((2, 1, H), dtype=torch.float32)  # exllamav3's eshape: [tokens, 1, hidden]
    t.routed_sum(0, routed)
    assert not t.producer.collected  # another layer's sum: untouched
    t.routed_sum(1, routed)
    status, shape, ptr, timeout, per_expert, floor = t.producer.collected[0]
    # a stop-loss wait: the job's experts' link time (the producer's kernel multiplies by the experts sent)
    assert (status, shape, ptr, timeout, per_expert, floor) == (1, (2, H), routed.data_ptr(), 0.05, 2e-4, TUNING.stop_loss_floor_s)
    # then the fallback plan from the collection's outcome, and the layer's own fused kernel on the same sum
    assert t.producer.planned == [(1, 1, 2, 8, 3)]
    [(y_ptr, acc_ptr, acc_shape, *plan)] = t.fallbacks[1].calls
    assert (y_ptr, acc_ptr, acc_shape, plan) == (z.data_ptr(), routed.data_ptr(), (2, H), ["count", "tokens", "weights"])
    assert not t.fallbacks[0].calls and bool((routed == 11).all())
    t.routed_sum(1, routed)
    assert len(t.producer.collected) == 1  # collected once


def test_while_the_table_sends_the_cpu_nothing_one_step_in_probe_steps_publishes_shadow_jobs(make_tier):
    t = make_tier(SLOW)
    assert t.controller.state is State.RESTING
    for _ in range(PROBE_STEPS - 1):
        t.after_step()
        assert t.controller.state is State.RESTING
    t.after_step()
    assert t.controller.state is State.PROBING
    # the probe step is a sampled step too (the GPU computes all its misses): before and after the split, at the sum
    FakeEvent.clock[:] = [1.0, 1.00002, 1.001]
    t.routed(0, *routing(T=1))
    assert t.producer.published[-1][-1] == TUNING.probe_experts and t._job is None  # a shadow job is never collected
    routed = torch.zeros((1, 1, H), dtype=torch.float32)
    t.routed_sum(0, routed)
    assert not t.producer.collected and not t.fallbacks[0].calls and bool((routed == 0).all())
    t.after_step()
    assert t.controller.state is State.REFRESHING
    published = len(t.producer.published)
    t.routed(0, *routing(T=1))  # no probe step: nothing is launched at all (the layer runs as in exact mode)
    assert len(t.producer.published) == published and t._job is None
    t.use_costs(COSTS)  # the table sends the CPU experts again: no more probes
    assert torch.equal(t.cube, torch.from_numpy(COSTS.table(8, 64)))
    for _ in range(PROBE_STEPS):
        t.after_step()
        assert t.controller.state is State.RUNNING


def test_the_worker_spins_through_steps_that_may_publish_jobs_and_rests_after_every_step(make_tier):
    """A worker that naps misses a job published in its nap (the GPU's wait is shorter than a nap): it is woken
    before every step the table may send it jobs in, probe steps too, and told after each that the step is over.
    While the table sends the CPU nothing, it is left asleep."""
    t = make_tier()
    t.before_step()
    t.after_step()
    assert (t.worker.woken, t.worker.rested) == (1, 1)
    t.use_costs(SLOW)
    woken = []
    for _ in range(4 * PROBE_STEPS):  # probes at steps 9 and 26 (the second interval doubled)
        probing, before = t.controller.probing, t.worker.woken
        t.before_step()
        woken.append(t.worker.woken - before)
        assert woken[-1] == int(probing)
        t.after_step()
    assert sum(woken) == 2 and t.worker.rested == 1 + 4 * PROBE_STEPS  # woken for the two probe steps alone


def test_the_tier_stays_out_of_steps_it_cannot_take_and_while_paused(make_tier):
    t = make_tier()
    t.routed(0, *routing(T=9))  # more rows than a decode step
    t.routed(0, *routing(T=1, dtype=torch.float32))  # router weights exllamav3's fused kernels do not read
    assert t.skipped == 2 and not t.producer.published
    with t.paused():
        t.routed(0, *routing(T=1))
    assert t.enabled and not t.producer.published and t._job is None


def test_a_routed_sum_that_is_not_fp32_fails_loudly(make_tier):
    t = make_tier()
    t.routed(0, *routing(T=1))
    with pytest.raises(RuntimeError, match="fp32"):
        t.routed_sum(0, torch.zeros((1, 1, H), dtype=torch.float16))


def test_stats_report_the_split_the_fallbacks_the_state_and_the_parked_worker(make_tier):
    t = make_tier()
    t.producer.counters.update(fallback_jobs=2, fallback_experts=3, taken_back_after_claim=2)
    stats = t.stats()
    assert stats["split"]["cpu_experts"] == 0 and stats["split"]["cpu_off"] is False and stats["state"] == "running"
    assert stats["device"]["fallback_jobs"] == 2 and stats["device"]["fallback_experts"] == 3
    assert stats["costs"]["cpu_expert_us"] == {1: 100.0} and stats["worker"]["parked"] is True
    assert set(stats["worth"]["hook_parts_us_per_layer"]) == set(ft.HOOK_PARTS)
    assert stats["worth"]["hook_parts_us_per_layer"]["collect"] is None  # no layer taken part in yet
    t.routed(0, *routing(T=1))
    t.routed_sum(0, torch.zeros((1, 1, H), dtype=torch.float32))
    parts = t.stats()["worth"]["hook_parts_us_per_layer"]
    assert t.hooked_layers == 1 and all(v >= 0 for v in parts.values())


def test_the_cost_table_follows_the_workers_live_timings_within_a_refresh(make_tier):
    t = make_tier(Costs({1: 100e-6}, 0.0, 190e-6, 0.0, sources={"cpu_expert_s": "timed"}))
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


def test_jobs_the_worker_never_claimed_turn_the_cpu_off_until_shadow_jobs_time_it_again(make_tier):
    t = make_tier(Costs({1: 100e-6, 8: 300e-6}, 0.0, 190e-6, 0.0, sources={"cpu_expert_s": "timed"}))
    assert not t.controller.cpu_off
    t.producer.counters.update(published=10, taken_back_before_claim=1)  # one unclaimed job: a worker waking up
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert not t.controller.cpu_off
    t.producer.counters.update(published=20, taken_back_before_claim=4)  # 3 of 10: a starved host
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert t.controller.cpu_off and not t.cube.any() and "starved" in t.costs.sources["cpu_expert_s"]
    assert t.costs.cpu_expert_s[8] / t.costs.cpu_expert_s[1] == pytest.approx(3.0)  # ratios kept for the recovery
    # the shadow jobs of the probe steps show a free host again: 100 us an expert; the figures come down step by step
    busy = 0.0
    for window in range(1, 30):
        busy += 24 * 100e-6
        t.worker.live = {"jobs": 12 * window, "experts": 24 * window, "tokens": 12 * window, "busy_s": busy}
        for _ in range(REFRESH_STEPS):
            t.after_step()
        if not t.controller.cpu_off:
            break
    assert window < 20, window  # within a few refreshes
    for window in range(window + 1, window + 30):
        busy += 24 * 100e-6
        t.worker.live = {"jobs": 12 * window, "experts": 24 * window, "tokens": 12 * window, "busy_s": busy}
        for _ in range(REFRESH_STEPS):
            t.after_step()
    assert t.costs.cpu_expert_s[1] == pytest.approx(100e-6, rel=0.01) and int(t.cube[1, 0, 4]) == 3
    assert t.costs.cpu_expert_s[8] == pytest.approx(300e-6, rel=0.01)


def test_late_jobs_double_what_the_worker_shows_without_compounding_and_clean_windows_bring_it_down_slowly(make_tier):
    t = make_tier(Costs({1: 100e-6}, 0.0, 190e-6, 0.0, sources={"cpu_expert_s": "timed"}, cpu_job_s={1: 50e-6}))
    t.producer.counters.update(published=20, done=18, fallback_jobs=2)  # 2 of 20 late: over late_share
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


def test_the_gpu_part_of_sampled_steps_sets_the_link_and_fixed_costs(make_tier):
    """One step in sample_steps has every layer's GPU part timed (between the split and the wait for the CPU); at
    the refresh a line through (GPU misses, seconds) replaces the start-up probe's link figure."""
    # the hooks weighed at nothing: the fakes' host time must not make the tier rest (the controller's own test)
    t = make_tier(Costs({1: 400e-6}, 0.0, 184e-6, 0.0, sources={"cpu_expert_s": "timed"}, cpu_pinned=True),
                  replace(TUNING, hook_weight=0.0))
    x = torch.zeros((1, H), dtype=torch.float32)
    timed = 0
    steps = 8 * SAMPLE_STEPS  # enough sampled layers for a line (fit_gpu_line's minimum)
    assert steps % REFRESH_STEPS == 0
    for step in range(1, steps + 1):
        if t.controller.sampling:
            for row, gpu_misses in ((0, 2), (1, 5)) * 6:  # 12 layers; the fake split sends no expert to the CPU
                t.producer.next_info = torch.tensor([1, gpu_misses, 0, 0], dtype=torch.int32)
                own = 75e-6 + gpu_misses * 198e-6  # between the split and the collect: the GPU's own part
                FakeEvent.clock[:] = [1.0 - 20e-6, 1.0, 1.0 + own, 1.0 + own + 30e-6]
                t.routed(row, *routing(T=1))
                t.routed_sum(row, x)
                timed += 1
        t.after_step()
    assert timed == 12 * (steps // SAMPLE_STEPS - 1)  # the last sampled step's layers run after the refresh
    assert t.costs.link_expert_s == pytest.approx(198e-6) and t.costs.gpu_fixed_s == pytest.approx(75e-6)
    assert "live" in t.costs.sources["link_expert_s"] and t.stats()["costs"]["gpu_fixed_us"] == 75.0
    assert torch.equal(t.cube, torch.from_numpy(t.costs.table(8, 64)))
    # the same layers sent the CPU nothing: 20 us in the split and 30 from the collect to the fallback's launch
    assert t.controller.worth.hook_gpu_s == pytest.approx(50e-6) and t.stats()["worth"]["hooks_gpu_us_per_layer"] == 50.0


def test_a_tuned_tier_follows_its_variant_within_and_its_own_tuning_after(make_tier):
    """bench.fast_ablation's runs: a variant of the tuning for a block (here no refreshes), the tier's own after."""
    t = make_tier(Costs({1: 100e-6}, 0.0, 190e-6, 0.0, sources={"cpu_expert_s": "timed"}))
    own = t.tuning
    t.worker.live = {"jobs": 10, "experts": 10, "tokens": 10, "busy_s": 10 * 400e-6}
    with t.tuned(replace(own, refresh_steps=1 << 40)):
        for _ in range(2 * REFRESH_STEPS):
            t.after_step()
        assert t.costs.cpu_expert_s[1] == pytest.approx(100e-6)  # never refreshed
    assert t.tuning is own
    for _ in range(REFRESH_STEPS):
        t.after_step()
    assert t.costs.cpu_expert_s[1] == pytest.approx(400e-6)


def test_a_resting_tier_launches_nothing_but_probes_and_gives_the_feeding_thread_its_cpus_back(make_tier):
    t = make_tier()
    t.feeding.confine()
    t.routed(0, *routing(T=1))
    t.routed_sum(0, torch.zeros((1, 1, H), dtype=torch.float32))
    worth = t.controller.worth
    assert len(t.producer.published) == 1 and worth._layers == 1 and worth._sum > 0  # the hooks' host time
    worth.resting = True
    t.routed(0, *routing(T=1))
    assert len(t.producer.published) == 1 and t._job is None
    t.before_step()
    assert t.worker.woken == 0
    t.after_step()
    assert not t.feeding.confined and t.controller.state is State.RESTING
    for _ in range(PROBE_STEPS - 1):
        t.after_step()
    assert t.controller.state is State.PROBING
    t.before_step()
    assert t.worker.woken == 1
    FakeEvent.clock[:] = [1.0, 1.001]
    t.routed(0, *routing(T=1))
    assert t.producer.published[-1][-1] == TUNING.probe_experts
    worth.resting = False
    t.after_step()
    assert t.feeding.confined and t.controller.state is State.RUNNING


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
        def __init__(self, *args, ram_tier=None):
            self.args, self.ram_tier = args, ram_tier

        def worthwhile(self):
            return worthwhile, "a one-expert CPU job costs more"

        def close(self):
            closed.append(self)

    monkeypatch.setattr(ft, "FastTier", Tier)
    settings = type("S", (), {"ct_enable": enable})()
    tier, off = ft.start(settings, "store", "cache", "device", "kernels", ["fallback"], 8, 7.0, ram_tier="the RAM tier")
    if on:
        assert isinstance(tier, Tier) and off is None and not closed
        assert tier.args == (settings, "store", "cache", "device", "kernels", ["fallback"], 8, 7.0)
        assert tier.ram_tier == "the RAM tier"
    else:
        assert tier is None and len(closed) == 1
        assert off == "the measured costs give it no share of the misses: a one-expert CPU job costs more"


def test_beside_a_ram_tier_the_tier_follows_each_move_and_keeps_the_disk_reader_off_its_cpus(make_tier):
    ram_tier = FakeRamTier()
    t = make_tier(ram_tier=ram_tier)
    assert t.timed_on == [[(0, 0)]]  # the CPU is timed on the experts whose bytes are in RAM now
    assert ram_tier.reader.moves == [[0]]  # the reader's threads on the CPUs the tier leaves (FakeFeeding.rest)
    repointed = []
    t.worker.repoint = lambda row, experts, trellises: repointed.append((row, list(experts), trellises.tolist()))
    t.repoint(1, np.array([2]), np.array([4096]))
    assert repointed == [(1, [2], [[4096, 4352, 4608]])] and t.stats()["repointed"] == 1 and t.stats()["beside_ram_tier"]
    t.controller.worth.resting = True  # resting, the tier gives every CPU back, the reader's threads too
    t.after_step()
    assert not t.feeding.confined and ram_tier.reader.moves == [[0], None]
    for _ in range(PROBE_STEPS - 1):
        t.after_step()
    t.controller.worth.resting = False  # running again
    t.after_step()
    assert t.feeding.confined and ram_tier.reader.moves == [[0], None, [0]]
    t.close()
    assert ram_tier.reader.moves == [[0], None, [0], None]  # back where it started: the reader outlives the tier
