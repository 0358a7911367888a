"""glm53.offload.prefetch.PredictionSchedule, prefetch's host-side decisions, on the CPU with the router's prediction
stubbed (the device side runs in tests/gpu/test_prefetch.py): which steps have their next layer predicted, what a
layer's end hands over for its plan, the lead's prediction and the oracle's replay."""

from __future__ import annotations

import torch

from glm53.offload.prefetch import PREDICT_MAX_ROWS, PrecisionGate, Prediction, PredictionSchedule

LAYERS = 3


class RouterStub:
    """The router's prediction made on the side stream, stubbed: it remembers which layers it predicted."""

    def __init__(self):
        self.predicted_for: list[int] = []

    def __call__(self, row: int, z: torch.Tensor) -> Prediction:
        self.predicted_for.append(row)
        return Prediction(torch.full((z.shape[0], 2), row), None)


def schedule(max_rows: int = PREDICT_MAX_ROWS, lead: bool = True, gate: PrecisionGate | None = None):
    router = RouterStub()
    return PredictionSchedule(LAYERS, router, max_rows, lead, gate), router


def routing(rows: int, expert: int = 0):
    """(selected, router input) of one layer's routing."""
    return torch.full((rows, 8), expert, dtype=torch.int64), torch.zeros((rows, 16), dtype=torch.float16)


def test_a_step_of_several_streams_is_not_predicted_and_its_calls_still_count():
    s, router = schedule()
    assert PREDICT_MAX_ROWS == 1
    sel, z = routing(4)
    s.routed(0, sel, z)
    assert s.picks[0] is sel and router.predicted_for == [] and s.calls == 1  # the oracle's replay stays aligned
    end = s.layer_end(0)
    assert end.picks is sel and end.plan is None  # nothing predicted: no plan for layer 1
    assert s.picks[0] is None and s.planned == [False] * LAYERS


def test_a_single_stream_step_predicts_the_next_layer_at_its_routing_and_none_after_the_last():
    s, router = schedule()
    s.routed(0, *routing(1))
    assert router.predicted_for == [1] and s.predictions[1].experts.eq(1).all()  # made before layer 0's experts
    plan = s.layer_end(0).plan
    assert plan.experts.eq(1).all() and s.predictions[1] is None  # handed to layer 0's end once, for its plan
    s.routed(LAYERS - 1, *routing(1))
    assert router.predicted_for == [1] and s.layer_end(LAYERS - 1).plan is None  # the last layer has no next one
    wide, router = schedule(max_rows=4)
    wide.routed(1, *routing(4))
    assert router.predicted_for == [2]


def test_a_forward_drops_the_last_ones_picks_and_predictions_and_names_the_plans_left_in_flight():
    s, _ = schedule()
    s.routed(0, *routing(1))
    s.plan_made(2)  # a forward that stopped after layer 1's end (an error)
    assert s.forward_start() == [2]
    assert s.picks == [None] * LAYERS and s.predictions == [None] * LAYERS
    s.released(2)
    assert s.planned == [False] * LAYERS and s.forward_start() == []


def test_the_first_layers_picks_are_kept_for_the_next_steps_lead_unless_the_oracle_replays():
    s, _ = schedule()
    assert s.lead(1) is None  # no step before: nothing to predict by
    sel, z = routing(1, expert=5)
    s.routed(0, sel, z)
    assert torch.equal(s.last_first, sel) and s.last_first is not sel  # a copy: exllamav3 reuses the buffer
    s.routed(1, *routing(1, expert=6))
    assert torch.equal(s.last_first, sel)  # only the first MoE layer's
    assert torch.equal(s.lead(1), sel) and s.lead(2) is None  # a step of two rows is not predicted by one of one
    replaying, _ = schedule()
    replaying.replay([])
    replaying.routed(0, sel, z)
    assert replaying.last_first is None


def test_no_lead_when_it_is_off_or_the_step_has_more_rows_than_are_prefetched():
    off, _ = schedule(lead=False)
    off.routed(0, *routing(1))
    assert off.last_first is None and off.lead(1) is None
    off.replay([routing(1)[0]])
    assert off.lead(1) is None  # nor the oracle's
    wide, _ = schedule(max_rows=4)
    wide.routed(0, *routing(4))
    assert wide.lead(4) is not None and wide.lead(2) is None  # the last step had four rows, this one two
    narrow, _ = schedule(max_rows=1)
    narrow.replay([routing(2)[0]])
    assert narrow.lead(2) is None


def test_the_oracle_replays_the_recorded_picks_call_by_call_across_steps_of_any_rows():
    s, router = schedule()
    s.routed(0, *routing(1, expert=7))  # before the recording: not part of it
    s.record()
    for step in range(2):
        rows = 1 if step == 0 else 3  # a step of several streams is recorded too: the replay's positions stay aligned
        for layer in range(LAYERS):
            s.routed(layer, *routing(rows, expert=10 * step + layer))
    recorded = s.recorded()
    assert [int(r[0, 0]) for r in recorded] == [0, 1, 2, 10, 11, 12] and s.calls == 6 and not s.replaying
    router.predicted_for.clear()
    assert s.replay(recorded) == recorded and s.replaying and s.recorded() == []
    assert torch.equal(s.lead(1), recorded[0])  # this step's true picks of the first layer
    for layer in range(LAYERS):
        s.routed(layer, *routing(1, expert=99))
        if layer + 1 < LAYERS:
            assert torch.equal(s.predictions[layer + 1].experts, recorded[layer + 1]) and s.predictions[layer + 1].scores is None
    assert router.predicted_for == [] and s.lead(3) is None  # the next step was recorded with three rows, not one
    for layer in range(LAYERS):
        s.routed(layer, *routing(3, expert=99))
    assert s.calls == 6 and s.lead(1) is None  # past the recorded run
    s.replay(None)
    s.routed(0, *routing(1))
    assert not s.replaying and router.predicted_for == [1]  # back to the router

