"""glm53.offload.prefetch.Prefetcher's hooks on the CPU, with the side stream's work stubbed (the device side runs in
tests/gpu/test_prefetch.py): which steps have their next layer predicted, and when the plan is made."""

from __future__ import annotations

import torch

from glm53.offload.prefetch import PREDICT_MAX_ROWS, Prefetcher

LAYERS = 3


def prefetcher(max_rows: int = PREDICT_MAX_ROWS) -> Prefetcher:
    p = object.__new__(Prefetcher)
    p.max_rows, p.routers = max_rows, [None] * LAYERS
    p.planned, p._picks, p._predictions = [False] * LAYERS, [None] * LAYERS, [None] * LAYERS
    p._recording, p._oracle, p._calls = None, None, 0
    p.leads, p._last_first = True, None
    p.min_score, p.budget, p.gate = None, None, None
    p.predicted_for = []
    p._predict_on_side = lambda row, z: p.predicted_for.append(row) or f"prediction of {row}"
    return p


def routing(rows: int):
    """(selected, router weights, router input): the weights are not the prefetcher's concern."""
    return torch.zeros((rows, 8), dtype=torch.int64), None, torch.zeros((rows, 16), dtype=torch.float16)


def test_a_step_of_several_streams_is_not_predicted_and_its_calls_still_count():
    p = prefetcher()
    assert PREDICT_MAX_ROWS == 1
    sel, _, z = routing(4)
    p.routed(0, sel, None, z)
    assert p._picks[0] is sel and p.predicted_for == [] and p._calls == 1  # the oracle's replay stays aligned
    p.after_layer(0)  # nothing predicted: no plan for layer 1
    assert p.planned == [False] * LAYERS and p._picks[0] is None


def test_a_single_stream_step_predicts_the_next_layer_at_its_routing_and_none_after_the_last():
    p = prefetcher()
    p.routed(0, *routing(1))
    assert p.predicted_for == [1] and p._predictions[1] == "prediction of 1"  # made before layer 0's experts
    p.routed(LAYERS - 1, *routing(1))
    assert p.predicted_for == [1]  # the last layer has no next one
    wide = prefetcher(max_rows=4)
    wide.routed(1, *routing(4))
    assert wide.predicted_for == [2]


def test_the_first_layers_picks_are_kept_for_the_next_steps_lead_unless_the_oracle_replays():
    p = prefetcher()
    sel, _, z = routing(1)
    p.routed(0, sel, None, z)
    assert torch.equal(p._last_first, sel) and p._last_first is not sel  # a copy: exllamav3 reuses the buffer
    p.routed(1, torch.ones((1, 8), dtype=torch.int64), None, z)
    assert torch.equal(p._last_first, sel)  # only the first MoE layer's
    p._last_first, p._oracle = None, []
    p.routed(0, sel, None, z)
    assert p._last_first is None
