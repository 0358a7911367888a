"""glm53.offload.prefetch.Prefetcher's hooks on the CPU, where they launch nothing (the device side runs in
tests/gpu/test_prefetch.py): which steps keep their router input for the next layer's prediction."""

from __future__ import annotations

import torch

from glm53.offload.prefetch import PREDICT_MAX_ROWS, Prefetcher

LAYERS = 3


def prefetcher(max_rows: int = PREDICT_MAX_ROWS) -> Prefetcher:
    p = object.__new__(Prefetcher)
    p.max_rows, p.routers = max_rows, [None] * LAYERS
    p.planned, p._picks, p._inputs = [False] * LAYERS, [None] * LAYERS, [None] * LAYERS
    p._recording, p._oracle, p._calls = None, None, 0
    return p


def test_a_step_of_several_streams_is_not_prefetched_and_its_calls_still_count():
    p = prefetcher()
    assert PREDICT_MAX_ROWS == 1
    sel, z = torch.zeros((4, 8), dtype=torch.int64), torch.zeros((4, 16), dtype=torch.float16)
    p.routed(0, sel, z)
    assert p._picks[0] is sel and p._inputs[0] is None and p._calls == 1  # the oracle's replay stays aligned
    p.after_layer(0)  # nothing to predict from: no stream work, no plan for layer 1
    assert p.planned == [False] * LAYERS and p._picks[0] is None


def test_a_single_stream_step_keeps_its_router_input_and_a_wider_limit_keeps_batches():
    sel1, z1 = torch.zeros((1, 8), dtype=torch.int64), torch.zeros((1, 16), dtype=torch.float16)
    p = prefetcher()
    p.routed(0, sel1, z1)
    assert p._inputs[0] is z1
    wide = prefetcher(max_rows=4)
    z4 = torch.zeros((4, 16), dtype=torch.float16)
    wide.routed(1, torch.zeros((4, 8), dtype=torch.int64), z4)
    assert wide._inputs[1] is z4
