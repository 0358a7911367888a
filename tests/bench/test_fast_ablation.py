"""bench/fast_ablation.py's host-side parts (the engines run on the GPU: tests/gpu/test_bench_tools.py)."""

from __future__ import annotations

import pytest

from bench.fast_ablation import NEVER, StepTimer, run_tuning
from glm53.cpu_tier.tuning import Tuning


class FakePath:
    def logits(self, ids):
        import torch

        return torch.tensor([0.0, 1.0, 0.5])


def test_the_step_timer_times_both_hooks_and_the_forward_of_every_step():
    calls = []
    timer = StepTimer(lambda: calls.append("before"), lambda: calls.append("after"))
    assert [timer.logits(FakePath(), [1]) for _ in range(3)] == [1, 1, 1]
    assert calls == ["before", "after"] * 3
    summary = timer.summary()
    assert set(summary) == {"before_step_us", "forward_launch_us", "forward_us", "after_step_us"}
    assert summary["forward_launch_us"]["mean"] <= summary["forward_us"]["mean"]
    assert all(v["mean"] >= 0 and v["max"] >= v["p90"] for v in summary.values())
    assert StepTimer().summary()["forward_us"]["mean"] is None  # no steps: nothing to report


@pytest.mark.parametrize("run, changed", [("tier", {}), ("inert", {}), ("no-rest", {"hook_weight": 0.0}),
                                         ("gpu-worth", {"hook_cost": "gpu"}), ("no-probes", {"probe_steps": NEVER}),
                                         ("no-refresh", {"probe_steps": NEVER, "refresh_steps": NEVER, "sample_steps": NEVER})])
def test_each_fast_run_passes_the_tier_its_variant_of_the_tuning(run, changed):
    base = Tuning(probe_near=0.25)  # the engine's tuning, whatever it is, is the one changed
    tuning = run_tuning(run, base)
    assert {k: v for k, v in vars(tuning).items() if vars(base)[k] != v} == changed and tuning.probe_near == 0.25
