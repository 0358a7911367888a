"""Prefetch's precision gate (glm53.offload.prefetch.PrecisionGate) on the CPU: a layer whose copies go unused stops
planning for a while and tries again; one whose copies are used never stops; and the prefetch schedule asks
it before it predicts or leads a layer."""

from __future__ import annotations

import pytest

from glm53.offload.prefetch import PrecisionGate
from tests.offload.test_prefetcher_hooks import routing, schedule


def test_a_layer_whose_copies_go_unused_rests_then_tries_again():
    gate = PrecisionGate(layers=2, min_precision=0.5, window=8, rest=3)
    gate.observe(1, copied=4, used=1)
    assert gate.allows(1)  # 4 copies: not enough to decide
    gate.observe(1, copied=4, used=2)  # 3 of 8 used: below half
    assert not gate.allows(1) and gate.allows(0) and gate.counts["closed"] == 1
    gate.observe(1, copied=8, used=0)  # copies planned before it closed say nothing about later
    for _ in range(2):
        gate.forward_start()
        assert not gate.allows(1)
    gate.forward_start()
    assert gate.allows(1) and gate.counts == {"closed": 1, "reopened": 1, "skipped_plans": 3}
    gate.observe(1, copied=8, used=4)  # exactly half: stays open
    assert gate.allows(1) and gate.stats()["resting_layers"] == 0


def test_a_layer_whose_copies_are_used_never_rests():
    gate = PrecisionGate(layers=1, min_precision=0.6, window=10, rest=5)
    for _ in range(50):
        gate.observe(0, copied=5, used=4)
        gate.forward_start()
        assert gate.allows(0)
    assert gate.counts["closed"] == 0


@pytest.mark.parametrize("kwargs", [{"min_precision": 1.5}, {"min_precision": -0.1}, {"min_precision": 0.5, "window": 0},
                                    {"min_precision": 0.5, "rest": 0}])
def test_bad_gate_settings_are_refused_with_what_is_accepted(kwargs):
    with pytest.raises(ValueError, match=r"min_precision .* must be in \[0, 1\], window .* and rest .* at least 1"):
        PrecisionGate(layers=1, **kwargs)


def test_the_schedule_neither_predicts_nor_leads_a_layer_the_gate_rests():
    gate = PrecisionGate(layers=3, min_precision=0.9, window=1, rest=2)
    gate.observe(2, copied=1, used=0)
    gate.observe(0, copied=1, used=0)
    s, router = schedule(gate=gate)
    s.routed(0, *routing(1))
    assert s.lead(1) is None  # layer 0 rests: no lead although the last step's picks are there
    s.routed(1, *routing(1))
    assert router.predicted_for == [1]  # layer 2 rests: no prediction, so no plan after layer 1
    assert s.layer_end(1).plan is None and gate.counts["skipped_plans"] == 2
