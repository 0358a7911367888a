"""bench/fast_ablation.py's host-side parts (the engines run on the GPU: tests/gpu/test_bench_tools.py)."""

from __future__ import annotations

import pytest

from bench.fast_ablation import StepTimer, tier_constants
from glm53.cpu_tier import tier


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


def test_tier_constants_are_set_for_the_block_and_put_back_after_it_even_on_error():
    before = tier.PROBE_STEPS
    with pytest.raises(RuntimeError), tier_constants(PROBE_STEPS=1 << 40):
        assert tier.PROBE_STEPS == 1 << 40
        raise RuntimeError
    assert tier.PROBE_STEPS == before
