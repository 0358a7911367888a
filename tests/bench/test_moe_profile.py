"""bench/moe_profile.py's tables from scripted per-call timings (no GPU): the per-miss line, the buckets, the steps."""

import numpy as np
import pytest

from bench import moe_profile


def calls(misses, cpu, gpu_us, wait_us, steps):
    n = len(misses)
    return {"row": np.arange(n) % 2, "misses": np.array(misses, dtype=np.int32), "cpu_experts": np.array(cpu, dtype=np.int32),
            "split_us": np.full(n, 10.0), "gpu_experts_us": np.array(gpu_us, dtype=float), "wait_us": np.array(wait_us, dtype=float),
            "steps": steps}


def test_the_line_through_the_gpu_part_is_per_gpu_miss():
    misses = [3, 5, 6, 4, 2, 5]
    cpu = [0, 1, 2, 0, 0, 0]
    gpu = [40 + 180 * (m - c) for m, c in zip(misses, cpu)]
    s = moe_profile.summarise(calls(misses, cpu, gpu, [5, 300, 500, 5, 5, 5], [(2000.0, 2), (2100.0, 2), (900.0, 1)]), layers=2)
    assert s["fit"] == {"fixed_us": pytest.approx(40.0), "per_miss_us": pytest.approx(180.0)}
    assert s["by_gpu_misses"][4] == {"calls": 3, "mean_us": 760.0, "p90_us": 760.0}
    assert s["by_cpu_experts"][0]["calls"] == 4 and s["by_cpu_experts"][2]["mean_us"] == 500.0
    assert s["step_us"] == 2050.0 and s["steps"] == 2  # the step with one layer's calls is left out
    assert s["misses_mean"] == pytest.approx(25 / 6, abs=1e-3) and s["cpu_experts_mean"] == 0.5


def test_one_miss_count_has_no_line():
    s = moe_profile.summarise(calls([4, 4], [0, 0], [700, 720], [1, 1], []), layers=2)
    assert s["fit"] is None and s["step_us"] is None


def test_the_windows_between_layers_before_the_first_and_after_the_last():
    c = calls([4, 4, 4, 4], [0] * 4, [700.0] * 4, [1.0] * 4, [(2000.0, 2), (2100.0, 2)])
    c.update(gaps=[(1, 160.0), (1, 170.0)], lead_us=np.array([900.0, 950.0]), tail_us=np.array([300.0, 320.0]))
    w = moe_profile.summarise(c, layers=2)["windows"]
    assert w == {"gap_us": 165.0, "gap_us_by_layer": {1: 165.0}, "lead_us": 925.0, "tail_us": 310.0}
    assert moe_profile.summarise(calls([4], [0], [700.0], [1.0], []), layers=1)["windows"]["gap_us"] is None  # none timed
