"""The fast mode's split cost model (glm53.cpu_tier.split): the split it chooses, the device table, the live
refresh, and timing the CPU kernel on real (random) experts."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from glm53.cpu_tier import kernel as ce
from glm53.cpu_tier.split import (
    GPU_LINE_MIN_SAMPLES,
    TOKENS,
    Costs,
    Window,
    fit_gpu_line,
    measure_cpu,
    pinned_cpu_cost,
)

from .test_worker import LIMIT, tier  # noqa: F401 (tier: fixture)

US = 1e-6
# a 24 GB card on PCIe 4: a 9.4 MB expert ~370 us over the link, ~5 us from VRAM; CPU 250 us per expert at 1 token
PCIE4 = Costs(cpu_expert_s={1: 250 * US, 2: 280 * US, 4: 350 * US, 8: 500 * US}, handoff_s=15 * US,
              link_expert_s=370 * US, vram_expert_s=5 * US)


def best_split(c: Costs, hits, misses, tokens):
    """The reference the device's table is checked against: how many of the misses go to the CPU, by trying every
    k (the first minimum: ties go to the fewest on the CPU)."""
    costs = [max(c.gpu_seconds(hits, misses - k), c.cpu_seconds(k, tokens)) for k in range(misses + 1)]
    return min(range(misses + 1), key=lambda k: (costs[k], k))


def test_the_split_balances_the_two_sides_and_the_table_holds_it():
    assert best_split(PCIE4, 8, 0, 1) == 0  # nothing missed: nothing to send
    k = best_split(PCIE4, 3, 5, 1)  # five misses: about half go to the CPU (250 us there against 370 us here)
    assert k == 3 and max(PCIE4.gpu_seconds(3, 2), PCIE4.cpu_seconds(3, 1)) < PCIE4.gpu_seconds(3, 5)
    table = PCIE4.table(max_tokens=8, max_experts=25)
    for hits, misses, tokens in itertools.product(range(9), range(17), (1, 3, 8)):
        assert table[tokens, hits, misses] == best_split(PCIE4, hits, misses, tokens)
    slow_cpu = Costs({1: 10e-3}, handoff_s=15 * US, link_expert_s=370 * US, vram_expert_s=5 * US)
    assert all(best_split(slow_cpu, 0, m, 1) == 0 for m in range(9))  # a CPU slower than the link gets nothing
    free_link = Costs({1: 250 * US}, handoff_s=15 * US, link_expert_s=0.0, vram_expert_s=0.0)
    assert best_split(free_link, 0, 8, 1) == 0  # ties go to the GPU


def test_more_misses_never_send_fewer_to_the_cpu():
    for tokens in (1, 8):
        ks = [best_split(PCIE4, 2, m, tokens) for m in range(40)]
        assert ks == sorted(ks)


def test_the_device_table_holds_the_split_of_every_cell():
    table = PCIE4.table(max_tokens=8, max_experts=24)
    assert table.shape == (9, 25, 25) and table.dtype == np.uint8
    for tokens, hits in itertools.product(range(1, 9), range(25)):
        for misses in range(25 - hits):
            assert table[tokens, hits, misses] == best_split(PCIE4, hits, misses, tokens)
    assert not table[0].any() and table[1, 20, 10] == 0  # impossible cells stay 0
    with pytest.raises(ValueError, match="max_tokens"):
        PCIE4.table(max_tokens=9, max_experts=8)


def test_token_counts_between_measured_ones_take_the_next_one_up():
    assert PCIE4.cpu_per_expert(3) == PCIE4.cpu_expert_s[4]
    assert PCIE4.cpu_per_expert(8) == PCIE4.cpu_expert_s[8]
    only_one = Costs({1: 100 * US}, 0.0, 1.0, 0.0)
    assert only_one.cpu_per_expert(4) == pytest.approx(400 * US)  # beyond the measured ones: proportional


@pytest.mark.parametrize("bad", [dict(handoff_s=-1.0), dict(link_expert_s=float("nan")), dict(cpu_expert_s={}),
                                 dict(cpu_expert_s={1: 0.0}), dict(cpu_expert_s={0: 1e-4})])
def test_impossible_figures_are_refused(bad):
    args = dict(cpu_expert_s={1: 1e-4}, handoff_s=1e-5, link_expert_s=1e-4, vram_expert_s=1e-6) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        Costs(**args)


def test_live_timings_move_the_cpu_figure_and_a_pinned_one_stays():
    fresh = PCIE4.refreshed(busy_s=0.030, experts=100, tokens=1)  # 300 us per expert seen live: averaged in
    assert fresh.cpu_expert_s[1] == pytest.approx(0.5 * 250 * US + 0.5 * 300 * US)
    factor = fresh.cpu_expert_s[1] / PCIE4.cpu_expert_s[1]  # a busy host is slower at every size
    assert fresh.cpu_expert_s[8] == pytest.approx(PCIE4.cpu_expert_s[8] * factor) and "refreshed" in fresh.sources["cpu_expert_s"]
    busy = PCIE4.refreshed(busy_s=0.100, experts=100, tokens=1)  # 1000 us: 4x the model, taken at once
    assert busy.cpu_expert_s[1] == pytest.approx(1000 * US) and busy.cpu_expert_s[8] == pytest.approx(4 * PCIE4.cpu_expert_s[8])
    free = busy.refreshed(busy_s=0.025, experts=100, tokens=1)  # and back, at most 1.25x a refresh
    assert free.cpu_expert_s[1] == pytest.approx(800 * US)
    for _ in range(16):
        free = free.refreshed(busy_s=0.025, experts=100, tokens=1)
    assert free.cpu_expert_s[1] == pytest.approx(250 * US, rel=0.01)
    late = PCIE4.slower(2.0)
    assert late.cpu_expert_s[8] == 2 * PCIE4.cpu_expert_s[8] and "late" in late.sources["cpu_expert_s"]
    assert PCIE4.refreshed(0.0, 0, 1) is PCIE4
    pinned = Costs(pinned_cpu_cost(0.25), 0.0, 1e-4, 0.0, sources={"cpu_expert_s": "GLM53_CT_B"}, cpu_pinned=True)
    assert pinned.cpu_expert_s == {1: 0.00025, 2: 0.00025, 4: 0.00025, 8: 0.00025}
    assert pinned.refreshed(1.0, 10, 1) is pinned


def test_the_cpu_kernel_is_timed_on_the_experts_given(tier):
    _, _, experts = tier
    lins = [experts[key] for key in sorted(experts)]
    with ce.Pool(threads=1, spin_us=100) as pool:
        per_expert, per_job = measure_cpu(lins, act_limit=LIMIT, pool=pool, tokens=(1, 4), batch=8, repeats=2)
    assert sorted(per_expert) == sorted(per_job) == [1, 4]
    assert all(0 < v < 0.1 for v in per_expert.values()) and all(0 <= v < 0.1 for v in per_job.values())
    with pytest.raises(ValueError, match="at least that many experts, got 8 and 3"):
        measure_cpu(lins[:3], act_limit=LIMIT, pool=None)


def test_a_jobs_fixed_cpu_time_counts_once_per_job():
    with_job = Costs({1: 200 * US}, handoff_s=10 * US, link_expert_s=190 * US, vram_expert_s=0.0, cpu_job_s={1: 500 * US})
    assert with_job.cpu_seconds(0, 1) == 0.0
    assert with_job.cpu_seconds(2, 1) == pytest.approx((10 + 500 + 2 * 200) * US)
    assert with_job.cpu_per_job(8) == 500 * US and PCIE4.cpu_per_job(1) == 0.0  # beyond the measured: the largest
    # 5 misses: without the job's part 2 go to the CPU (570 us); with it a job of 2 takes 910 us, of 1 710 (GPU 760)
    assert best_split(PCIE4_like(with_job, job=0.0), 0, 5, 1) == 2
    assert best_split(with_job, 0, 5, 1) == 1
    table = with_job.table(1, 8)
    assert all(table[1, 0, m] == best_split(with_job, 0, m, 1) for m in range(9))
    with pytest.raises(ValueError, match="cpu_job_s"):
        Costs({1: 1e-4}, 0.0, 1e-4, 0.0, cpu_job_s={1: -1.0})


def PCIE4_like(costs: Costs, job: float) -> Costs:
    from dataclasses import replace

    return replace(costs, cpu_job_s={1: job})


def test_a_live_refresh_scales_the_jobs_fixed_part_and_its_experts_alike():
    c = Costs({1: 200 * US}, 0.0, 1e-4, 0.0, cpu_job_s={1: 100 * US})
    fresh = c.refreshed(busy_s=10 * 400 * US, experts=10, tokens=1, jobs=10, weight=1.0)  # 400 us a job of 1, not 300
    assert fresh.cpu_seconds(1, 1) == pytest.approx(400 * US)
    assert fresh.cpu_expert_s[1] == pytest.approx(200 * US * 4 / 3) and fresh.cpu_job_s[1] == pytest.approx(100 * US * 4 / 3)


def test_figures_raised_by_late_jobs_come_back_to_what_the_worker_shows():
    """A burst of late windows raises the fixed and the per-expert parts (2x each time); clean windows then bring both
    back down, at most 1.25x a refresh, to the live figures: one burst never keeps the tier off for good (on the H200
    host the per-job part, raised with the rest and never refreshed, held a one-expert job at 18x its start-up time)."""
    c = Costs({1: 263 * US, 4: 400 * US}, 10 * US, 190 * US, 1 * US, cpu_job_s={1: 312 * US, 4: 330 * US})
    raised = c
    for _ in range(4):
        raised = raised.slower(2.0)
    assert raised.cpu_seconds(1, 1) == pytest.approx(10 * US + 16 * 575 * US)
    for refresh in range(30):  # each window: 40 one-expert jobs as fast as at start
        raised = raised.refreshed(busy_s=40 * 575 * US, experts=40, tokens=1, jobs=40)
    assert raised.cpu_expert_s[1] == pytest.approx(263 * US, rel=1e-3) and raised.cpu_job_s[1] == pytest.approx(312 * US, rel=1e-3)
    assert raised.cpu_expert_s[4] == pytest.approx(400 * US, rel=1e-3)


def test_the_split_sends_the_coldest_missed_experts_and_zeroes_only_their_weights():
    from glm53.cpu_tier.split import split_reference

    E = 16
    slot_of = np.full(E, -1)
    slot_of[[0, 1, 2]] = [5, 6, 7]  # experts 0-2 in VRAM
    freq = np.arange(E, dtype=np.float32)[::-1].copy()  # expert 15 the coldest
    sel = np.array([[0, 15, 9, 4], [15, 1, 3, 12]])  # expert 15 twice
    rw = np.array([[0.4, 0.3, 0.2, 0.1], [0.5, 0.25, 0.125, 0.125]], np.float16)
    table = np.zeros((3, 9, 9), np.uint8)
    table[2, 2, 5] = 2  # 2 tokens, 2 hits (0, 1), 5 misses (15, 9, 4, 3, 12): two to the CPU
    picks, kept, info = split_reference(sel, rw, slot_of, freq, table)
    assert info == {"hits": 2, "misses": 5, "experts": 2, "picks": 3}
    f16 = lambda v: float(np.float16(v))
    assert picks == [(0, 15, f16(0.3)), (1, 15, 0.5), (1, 12, 0.125)]  # the coldest two, 15 and 12, in pick order
    assert kept.dtype == np.float16 and kept.tolist() == [[f16(0.4), 0.0, f16(0.2), f16(0.1)], [0.0, 0.25, 0.125, 0.0]]
    table[2, 2, 5] = 9  # more than there are: all misses
    assert split_reference(sel, rw, slot_of, freq, table)[2]["experts"] == 5
    none, same, info = split_reference(sel, rw, slot_of, freq, np.zeros((2, 9, 9), np.uint8))  # 2 tokens: off the table
    assert none == [] and np.array_equal(same, rw) and info["experts"] == 0


def test_every_miss_to_the_cpu():
    from glm53.cpu_tier.split import every_miss_to_the_cpu

    c = every_miss_to_the_cpu(PCIE4)
    assert all(best_split(c, h, m, t) == m for t in (1, 2, 8) for h in (0, 3) for m in range(9))
    assert c.link_expert_s == PCIE4.link_expert_s and "a check" in c.sources["cpu_expert_s"]
    assert c.refreshed(busy_s=1.0, experts=10, tokens=1, jobs=10) is c  # live timings do not undo a check's costs


def test_the_gpus_line_is_fitted_from_its_own_timings_and_a_wild_one_is_refused():
    rng = np.random.default_rng(0)
    misses = rng.integers(0, 9, 200)
    seconds = 80 * US + 198 * US * misses + rng.normal(0, 5 * US, misses.size)
    fixed, per_miss = fit_gpu_line(misses, seconds, probe_s=184 * US)
    assert per_miss == pytest.approx(198 * US, rel=0.02) and fixed == pytest.approx(80 * US, abs=5 * US)
    slope, intercept = np.polyfit(misses, seconds, 1)  # the closed form is the least-squares line
    assert (per_miss, fixed) == pytest.approx((slope, intercept), rel=1e-9)
    few = GPU_LINE_MIN_SAMPLES - 1
    assert fit_gpu_line(misses[:few], seconds[:few], 184 * US) is None  # too few to tell
    assert fit_gpu_line(np.full(100, 4), np.full(100, 900 * US), 184 * US) is None  # one miss count: no slope
    assert fit_gpu_line(misses, seconds, probe_s=20 * US) is None  # 10x the probe: a stalled step, not the link


def test_a_window_keeps_the_latest_rows_of_its_columns():
    w = Window(4, 2)
    assert len(w) == 0 and [c.size for c in w.columns()] == [0, 0]
    for i in range(6):
        w.append(i, 10 * i)
    misses, seconds = w.columns()
    assert len(w) == 4 and sorted(misses) == [2, 3, 4, 5] and sorted(seconds) == [20, 30, 40, 50]


def test_the_table_drift_sees_a_moved_figure_and_not_a_tiny_one():
    c = PCIE4
    assert c.table_drift(c, 8) == 0.0
    assert c.table_drift(c.slower(1.2), 8) == pytest.approx(0.2 / 1.2, rel=1e-6)  # every CPU figure 20 % up
    assert c.table_drift(c.with_gpu_line(1 * US, c.link_expert_s), 8) < 0.25  # 1 us of fixed time: under the floor


def test_the_gpus_fixed_time_lets_the_cpu_take_more():
    """The GPU's part of a layer beyond its experts' runs while the CPU's job does, so it moves the balance."""
    c = Costs({1: 500 * US}, 0.0, 184 * US, 0.0, cpu_job_s={1: 60 * US})
    live = c.with_gpu_line(fixed_s=75 * US, per_miss_s=198 * US)
    # 3 misses: the GPU alone takes 552 us against 560 for a one-expert job; with 75 us of its own, 669 us
    assert best_split(c, 3, 3, 1) == 0 and best_split(live, 3, 3, 1) == 1
    assert live.gpu_seconds(2, 3) == pytest.approx(75 * US + 3 * 198 * US)
    table = live.table(1, 16)
    assert [int(table[1, 3, m]) for m in range(14)] == [best_split(live, 3, m, 1) for m in range(14)]
    assert "live" in live.sources["link_expert_s"]


def test_a_starved_host_gets_nothing_until_it_is_measured_again():
    starved = PCIE4.starved()
    assert not starved.table(8, 64).any() and "starved" in starved.sources["cpu_expert_s"]
    assert starved.cpu_expert_s[8] / starved.cpu_expert_s[1] == pytest.approx(PCIE4.cpu_expert_s[8] / PCIE4.cpu_expert_s[1])
    assert PCIE4.table(8, 64).any()
    pinned = replace(PCIE4, cpu_pinned=True)
    assert pinned.starved() is pinned


def test_the_closed_form_table_is_the_best_split_of_every_cell():
    """The table is computed in closed form (it is rebuilt every few decode steps); it must be exactly what the
    brute-force best_split says, ties included, for costs drawn at random and for degenerate ones."""
    rng = np.random.default_rng(3)
    cases = [PCIE4, replace(PCIE4, link_expert_s=0.0), replace(PCIE4, handoff_s=0.0, gpu_fixed_s=5e-4)]
    for _ in range(40):
        cases.append(Costs({t: float(rng.uniform(50, 2000)) * US for t in TOKENS}, handoff_s=float(rng.uniform(0, 300)) * US,
                           link_expert_s=float(rng.uniform(20, 600)) * US, vram_expert_s=float(rng.uniform(0, 5)) * US,
                           cpu_job_s={t: float(rng.uniform(0, 300)) * US for t in TOKENS}, gpu_fixed_s=float(rng.uniform(0, 100)) * US))
    for c in cases:
        table = c.table(8, 64)
        for tokens in (1, 2, 3, 8):
            for hits in (0, 3, 17):
                for misses in range(0, 64 - hits + 1, 3):
                    assert table[tokens, hits, misses] == best_split(c, hits, misses, tokens), (c, tokens, hits, misses)
