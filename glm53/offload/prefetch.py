"""Predictive prefetch in exact mode's decode (``GLM53_PREFETCH``): the link is idle while a layer's attention runs,
so the experts the next MoE layer will probably pick are copied then, into a small pool of VRAM slots, and read
from there like hits. The policy (prediction, which experts fill the pool, what counts) is written out in
``prefetch_policy``; the device runs it (``native/ec/prefetch.cuh``).

Per decode forward, on the compute stream C and a side stream P, for MoE layer ``l`` (in store order):

1. ``routed(l)``, after layer ``l``'s routing, before the cache's step: C waits for layer ``l``'s prefetch (if one
   was made); layer ``l``'s picks are kept; P waits for C and predicts layer ``l + 1``'s picks from layer ``l``'s
   router input with layer ``l + 1``'s router (sigmoid + correction bias, top ``top_k + extra``), while layer
   ``l``'s experts run (the prediction's kernels stay out of the window the copies have).
2. ``after_layer(l)``, once layer ``l``'s experts are launched: on C the pool is released (its experts pointed
   home again, what was used counted); then P waits for C, plans and copies the prediction, and records the event
   that step 1 of layer ``l + 1`` waits for. So the copies overlap layer ``l + 1``'s attention (the link is idle
   then: about one expert's copy on the H200 host), and one pool serves every layer in turn.
0. ``decode_start(rows)``, before a decode forward's first module (``lead``): the first MoE layer has no layer before it, but
   the link's longest idle window: the embedding, the dense layers and that layer's attention (1.7 ms a step on the
   scaled checkpoint, ``bench.moe_profile``'s ``lead_us``). Its prediction is the previous step's picks of that
   layer (the same stream's last token, on the bet that consecutive tokens share experts, which a synthetic
   checkpoint's do only by chance; the oracle: the true picks), copied on P at once; step 1 waits for it as for any
   plan. Off by default (``GLM53_PREFETCH_LEAD``).

The budget (``prefetch_policy``'s module docstring says why): a copy is planned only for a predicted expert whose
score clears ``min_score`` (``GLM53_PREFETCH_MIN_SCORE``; the lead's and the oracle's predictions have no score and
are not thresholded), and a layer plans at most the copies that start inside its window,
``budget_copies(window, copy rate)``. Both figures are measured on the running engine (``CopyBudget``): the copy rate
at start, by the copy kernel's grid reading the host store; the window on the compute stream, from the previous
layer's end (the lead's: the step's start) to this layer's routing point, on every ``WINDOW_SAMPLE_EVERY``-th decode
forward, read back once the device has passed it (no host sync). Until a layer's window is measured, its plans may
fill the pool. Before this budget the pool's slots were the only limit: 2 slots' copies (344 us on the H200 host)
overran the 132 us between two MoE layers, and the layer waited for them.

With ``GLM53_PREFETCH_MIN_PRECISION`` a layer whose recent copies were used at less than that share stops planning
for a while, then tries again (:class:`PrecisionGate`, fed the device's counters without a host sync).

Only where bytes are read from changes: the output is bit-identical (``tests/gpu/test_offload_exact.py``). A wrong
prediction costs link time that was idle. Not in prefill (staging reads every expert there), not in steps of
several streams (``PREDICT_MAX_ROWS``) and not with the CPU tier, whose split would count a prefetched expert as a
miss. For measurements, :meth:`Prefetcher.record` keeps the
true picks of a run and :meth:`Prefetcher.replay` prefetches exactly them in a second run of the same tokens (the
oracle: what the machinery gives with a perfect predictor).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .cache import ExpertCache, Policy
from .ec_native import PF_COUNTERS, EcPool, Kernels
from .part import Part
from .prefetch_policy import budget_copies


# Rows (streams decoded together) up to which the next layer is prefetched: at 4 streams the union of their picks
# is several times a small pool, and both the router's and the oracle's prefetch were 3-4 % slower than exact mode
# (bench/results/2026-12-01-third-session-h200.md); at 1 stream they gained 1-9 %.
PREDICT_MAX_ROWS = 1
WINDOW_SAMPLE_EVERY = 16  # decode forwards per measured one: two events a layer, a few microseconds of host time each
WINDOW_SAMPLES = 15  # per layer, the median of the latest


class WindowClock:
    """The idle window before each MoE layer's routing, timed on the compute stream by event pairs (``start`` at
    the previous layer's end or the step's start, ``end`` at the routing point) on every ``every``-th forward, and
    read back only once the device has passed a pair (``Event.query``: no host sync)."""

    def __init__(self, layers: int, every: int = WINDOW_SAMPLE_EVERY, keep: int = WINDOW_SAMPLES):
        self.every, self.forwards, self.sampling = every, 0, False
        self.samples = [deque(maxlen=keep) for _ in range(layers)]
        self._open: dict[int, torch.cuda.Event] = {}
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def forward_start(self) -> None:
        self._pending = [(row, a, b) for row, a, b in self._pending if not self._read(row, a, b)]
        self._open.clear()
        self.sampling = self.forwards % self.every == 0
        self.forwards += 1

    def start(self, row: int) -> None:
        if self.sampling:
            self._open[row] = self._mark()

    def end(self, row: int) -> None:
        begin = self._open.pop(row, None)
        if begin is not None:
            self._pending.append((row, begin, self._mark()))

    def window_s(self, row: int) -> float | None:
        """The median of layer ``row``'s latest windows in seconds (None: none measured yet)."""
        return statistics.median(self.samples[row]) if self.samples[row] else None

    def _read(self, row: int, begin: torch.cuda.Event, end: torch.cuda.Event) -> bool:
        if not end.query():
            return False
        self.samples[row].append(begin.elapsed_time(end) / 1000.0)
        return True

    @staticmethod
    def _mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class PrecisionGate:
    """Prefetch gated by its measured precision, per MoE layer: once a layer has made ``window`` copies since it last
    decided, the share of them its step used decides whether it goes on; below ``min_precision`` it plans nothing for
    the next ``rest`` decode forwards, then tries again (its copies start counting anew). A wrong prediction costs
    link time that overruns the idle window (bench/results/2026-12-02-offload-session3-h200.md: 0.97-1.08x on
    `trained`, a loss predicted on `random` at any score threshold), so a layer whose router predicts badly should not
    keep paying it. The counts come from the device's counters, read back without a host sync (:meth:`Prefetcher`
    mirrors them every ``WINDOW_SAMPLE_EVERY`` forwards)."""

    def __init__(self, layers: int, min_precision: float, window: int = 32, rest: int = 64):
        if not 0.0 <= min_precision <= 1.0 or window < 1 or rest < 1:
            raise ValueError(f"precision gate: min_precision {min_precision} must be in [0, 1], window {window} and rest {rest} at least 1")
        self.min_precision, self.window, self.rest = min_precision, window, rest
        self.copied = [0] * layers  # since the layer last decided
        self.used = [0] * layers
        self.resting = [0] * layers  # decode forwards left without plans
        self.counts = {"closed": 0, "reopened": 0, "skipped_plans": 0}

    def allows(self, row: int) -> bool:
        """Whether layer ``row`` plans in this decode forward (counted when it may not)."""
        if self.resting[row]:
            self.counts["skipped_plans"] += 1
            return False
        return True

    def forward_start(self) -> None:
        for row, left in enumerate(self.resting):
            if left:
                self.resting[row] = left - 1
                if left == 1:
                    self.counts["reopened"] += 1

    def observe(self, row: int, copied: int, used: int) -> None:
        """Layer ``row`` made ``copied`` more copies, of which its steps used ``used``."""
        if self.resting[row]:
            return  # copies planned before it closed: they say nothing about after it reopens
        self.copied[row] += copied
        self.used[row] += used
        if self.copied[row] >= self.window:
            if self.used[row] < self.min_precision * self.copied[row]:
                self.resting[row] = self.rest
                self.counts["closed"] += 1
            self.copied[row] = self.used[row] = 0

    def stats(self) -> dict:
        return {"min_precision": self.min_precision, "window": self.window, "rest": self.rest, **self.counts,
                "resting_layers": sum(1 for r in self.resting if r)}


class CopyBudget:
    """How many copies layer ``row`` may plan: ``budget_copies`` of its measured window and the copy rate, at most
    ``slots`` (all of them until its window is measured).

    :param copy_gbs: the prefetch copy's rate, GB/s (``measure_copy_gbs``).
    """

    def __init__(self, copy_gbs: float, block_bytes: int, layers: int, clock: WindowClock | None = None):
        self.copy_gbs, self.block_bytes = copy_gbs, block_bytes
        self.clock = clock or WindowClock(layers)

    def copies(self, row: int, slots: int) -> int:
        window = self.clock.window_s(row)
        return slots if window is None else min(slots, budget_copies(window, self.copy_gbs, self.block_bytes))

    def stats(self) -> dict:
        windows = [self.clock.window_s(r) for r in range(len(self.clock.samples))]
        return {"copy_gbs": round(self.copy_gbs, 2),
                "window_us": [None if w is None else round(w * 1e6, 1) for w in windows]}


class Prediction(NamedTuple):
    """A layer's predicted picks, made on the side stream for its plan."""

    experts: torch.Tensor  # int64 [rows, n], best first
    scores: torch.Tensor | None  # float32 [rows, n], or None: not thresholded (the lead's, the oracle's, no min_score)


class LayerEnd(NamedTuple):
    """What a layer's end hands :class:`Prefetcher` (:meth:`PredictionSchedule.layer_end`)."""

    picks: torch.Tensor | None  # the layer's picks, for its plan's release (None: its routing was not seen)
    plan: Prediction | None  # the next layer's prediction, to plan and copy now (None: none)


class PredictionSchedule:
    """Prefetch's host-side decisions in decode, apart from the device work that :class:`Prefetcher` does for them:
    which routing calls have the next layer predicted (steps of at most ``max_rows`` rows, every layer but the last,
    while the gate lets it plan), which layers have a plan in flight, the first MoE layer's picks kept for the next
    step's lead, and the oracle's record and replay of the true picks, aligned by the count of routing calls.

    :param layers: MoE layers (store order).
    :param predict: the router's prediction of layer ``row`` from the previous layer's router input ``z``
        (:meth:`Prefetcher._predict_on_side`); the oracle's replay does without it.
    :param max_rows: the most rows (streams) of a step that is prefetched.
    :param lead: predict the first MoE layer at each decode step's start (:meth:`lead`).
    :param gate: stops a layer's plans while its measured precision is low (None: never).
    """

    def __init__(self, layers: int, predict: Callable[[int, torch.Tensor], Prediction], max_rows: int = PREDICT_MAX_ROWS,
                 lead: bool = False, gate: PrecisionGate | None = None):
        self.layers, self.predict, self.max_rows, self.leads, self.gate = layers, predict, max_rows, lead, gate
        self.planned = [False] * layers  # layer l's plan is copied or being copied, not yet released
        self.picks: list[torch.Tensor | None] = [None] * layers  # this forward's, per layer
        self.predictions: list[Prediction | None] = [None] * layers  # this forward's, per layer, for its plan
        self.calls = 0  # routing calls seen (the position in a recorded run)
        self._recording: list[torch.Tensor] | None = None
        self._oracle: list[torch.Tensor] | None = None
        self.last_first: torch.Tensor | None = None  # the last decode step's picks of the first MoE layer (lead's prediction)

    def forward_start(self) -> list[int]:
        """A forward begins: the last one's picks and predictions are dropped. Returns the layers whose plans were
        left in flight by a forward that stopped before their layer (an error), to be waited for and released."""
        self.picks = [None] * self.layers
        self.predictions = [None] * self.layers
        return [row for row, planned in enumerate(self.planned) if planned]

    def lead(self, rows: int) -> torch.Tensor | None:
        """The first MoE layer's prediction at the start of a decode forward of ``rows`` rows: the previous step's
        picks of that layer when it had as many rows (the oracle's: this step's true picks); None: no lead."""
        if not self.leads or rows > self.max_rows or (self.gate is not None and not self.gate.allows(0)):
            return None
        predicted = self._oracle_picks() if self._oracle is not None else self.last_first
        return None if predicted is None or predicted.shape[0] != rows else predicted

    def routed(self, row: int, selected: torch.Tensor, z: torch.Tensor) -> None:
        """Layer ``row`` picked ``selected`` (int64 [rows, top_k]) from the router input ``z``: the picks are kept for
        its release, and the next layer is predicted now if this step qualifies."""
        self.picks[row] = selected
        if row == 0 and self.leads and self._oracle is None:
            self.last_first = selected.clone()  # exllamav3 reuses the buffer; the next step's lead reads it on P
        if self._recording is not None:
            self._recording.append(selected.clone())
        self.calls += 1  # the oracle's index of the next routing call: layer row + 1's
        nxt = row + 1
        if selected.shape[0] <= self.max_rows and nxt < self.layers and (self.gate is None or self.gate.allows(nxt)):
            self.predictions[nxt] = self._oracle_prediction() if self._oracle is not None else self.predict(nxt, z)

    def layer_end(self, row: int) -> LayerEnd:
        """Layer ``row``'s experts are launched: its picks and the next layer's prediction are handed over, once."""
        picks, self.picks[row] = self.picks[row], None
        nxt = row + 1
        if nxt >= self.layers:
            return LayerEnd(picks, None)
        predicted, self.predictions[nxt] = self.predictions[nxt], None
        return LayerEnd(picks, predicted)

    @property
    def replaying(self) -> bool:
        """Whether the predictions are a recorded run's true picks (the oracle)."""
        return self._oracle is not None

    def plan_made(self, row: int) -> None:
        self.planned[row] = True

    def released(self, row: int) -> None:
        self.planned[row] = False

    def _oracle_picks(self) -> torch.Tensor | None:
        """The recorded true picks of the next routing call (None past the recorded run)."""
        return self._oracle[self.calls] if self.calls < len(self._oracle) else None

    def _oracle_prediction(self) -> Prediction | None:
        picks = self._oracle_picks()
        return None if picks is None else Prediction(picks, None)

    def record(self) -> None:
        """Keep every decode routing call's true picks from now on (the oracle's first pass)."""
        self._recording, self._oracle, self.calls = [], None, 0

    def replay(self, picks: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """Predict exactly ``picks`` from now on, in routing-call order; None goes back to the router. Returns the
        picks it replays."""
        self._oracle = None if picks is None else list(picks)
        self._recording, self.calls = None, 0
        return self._oracle or []

    def recorded(self) -> list[torch.Tensor]:
        return list(self._recording or [])


def measure_copy_gbs(link, store, blocks: int) -> float:
    """The prefetch copy's rate on this machine: ``blocks`` thread blocks (its grid) reading the host store's
    first arena in place, through the offload's link (an emulated one's rate, when it emulates)."""
    arena = store.cuda_arena(0)
    return link.read_rate_gbs(arena[: min(1 << 28, arena.numel()) // 16 * 16], blocks)


class Prefetcher(Part):
    """Prefetch's device side: the pool, the side stream P, the predictions' kernels, the plans' copies and releases,
    their counters and the events between the streams; what is predicted when is its :class:`PredictionSchedule`'s.

    :param routers: per MoE layer (in store order) its router: (gate [hidden, experts] as exllamav3 holds it, the
        selection-only correction bias [experts] or None).
    :param slots: VRAM slots of the pool (the most experts copied ahead of a layer).
    :param extra: experts predicted per token beyond ``top_k``.
    :param max_rows: the most rows (streams) of a step that is prefetched.
    :param lead: prefetch the first MoE layer at each decode step's start (:meth:`decode_start`).
    :param min_score: the score a router-predicted expert must reach to be copied (None: every prediction).
    :param budget: the copies a layer may plan (None: the pool's slots).
    :param gate: stop a layer's plans while its measured precision is low (None: never).
    """

    name = "prefetch"

    def __init__(self, kernels: Kernels, cache: ExpertCache, routers: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                 slots: int, extra: int, top_k: int, device: torch.device, policy: Policy | None = None,
                 max_rows: int = PREDICT_MAX_ROWS, lead: bool = False, min_score: float | None = None,
                 budget: CopyBudget | None = None, gate: PrecisionGate | None = None):
        L = cache.store.num_layers
        if len(routers) != L:
            raise ValueError(f"{len(routers)} routers for {L} MoE layers")
        self.kernels, self.cache, self.device = kernels, cache, device
        self.policy = policy or Policy()
        self.block_bytes = cache.block_bytes
        self.top_k, self.extra, self.slots = top_k, extra, slots
        self.min_score, self.budget, self.gate = min_score, budget, gate
        self.routers = [(gate, None if bias is None else bias.float().to(device)) for gate, bias in routers]
        self.schedule = PredictionSchedule(L, self._predict_on_side, max_rows, lead, gate)
        self.buffer = torch.empty((slots, self.block_bytes), dtype=torch.uint8, device=device)
        i64 = {"dtype": torch.int64, "device": device}
        self.slot_addr = torch.tensor([self.buffer.data_ptr() + i * self.block_bytes for i in range(slots)], **i64)
        self.owner = torch.full((slots,), -1, dtype=torch.int32, device=device)
        self.num = torch.zeros((1,), dtype=torch.int32, device=device)
        self.counters = torch.zeros((L, len(PF_COUNTERS)), **i64)
        self.state = EcPool(slots=slots, slot_addr=self.slot_addr.data_ptr(), owner=self.owner.data_ptr(),
                            num=self.num.data_ptr(), counters=self.counters.data_ptr())
        self.stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range(L)]  # layer l's prefetch is in its slots
        self._no_picks = torch.zeros((0,), dtype=torch.int64, device=device)
        # the gate's view of the counters: a pinned copy made every WINDOW_SAMPLE_EVERY forwards, read once it has landed
        self._mirror = torch.zeros(self.counters.shape, dtype=torch.int64, pin_memory=torch.cuda.is_available())
        self._mirrored: torch.cuda.Event | None = None
        self._seen = torch.zeros(self.counters.shape, dtype=torch.int64)
        self._forwards = 0

    # ---- hooks (the offload's, ``part.Part``: on the compute stream, decode forwards only for routed)

    def forward_start(self) -> None:
        """Before a forward: a plan left from a forward that stopped before its layer (an error) is waited for and
        released, so that no table points into the pool outside the layer it was planned for."""
        for row in self.schedule.forward_start():
            torch.cuda.current_stream().wait_event(self.ready[row])
            self.kernels.prefetch_release(self.cache.state, self.state, row, self._no_picks)
            self.schedule.released(row)
        if self.budget is not None:
            self.budget.clock.forward_start()

    def _feed_gate(self) -> None:
        """Give the gate the copies and uses counted since the last mirror that has landed, and mirror anew every
        ``WINDOW_SAMPLE_EVERY`` decode forwards (no host sync: ``Event.query``)."""
        self.gate.forward_start()
        if self._mirrored is not None and self._mirrored.query():
            now = self._mirror.clone()
            delta = now - self._seen
            self._seen = now
            self._mirrored = None
            copied, used = PF_COUNTERS.index("copied"), PF_COUNTERS.index("used")
            for row in range(delta.shape[0]):
                self.gate.observe(row, int(delta[row, copied]), int(delta[row, used]))
        if self._mirrored is None and self._forwards % WINDOW_SAMPLE_EVERY == 0:
            self._mirror.copy_(self.counters, non_blocking=True)
            self._mirrored = torch.cuda.Event()
            self._mirrored.record()
        self._forwards += 1

    def routed(self, row: int, selected: torch.Tensor, weights: torch.Tensor | None, z: torch.Tensor) -> None:
        """After layer ``row``'s routing, before the cache's step. The schedule has the next layer predicted (from
        the router's input ``z``; the weights are not needed) in a step of at most ``max_rows`` rows."""
        if self.budget is not None:
            self.budget.clock.end(row)  # before the wait: the window is the compute stream's own time
        if self.schedule.planned[row]:
            torch.cuda.current_stream().wait_event(self.ready[row])
        self.schedule.routed(row, selected, z)

    def decode_start(self, rows: int) -> None:
        """Before a decode forward of ``rows`` rows (after :meth:`forward_start`): the first MoE layer's prefetch,
        planned and copied on P now, from the schedule's lead."""
        if self.gate is not None:
            self._feed_gate()  # here, not in forward_start: the gate rests a number of decode forwards
        predicted = self.schedule.lead(rows)
        if predicted is None:
            return
        if self.budget is not None:
            self.budget.clock.start(0)
        self.stream.wait_stream(torch.cuda.current_stream())  # after the last step's picks were copied and the pool released
        with torch.cuda.stream(self.stream):
            self.kernels.prefetch(self.cache.state, self.state, 0, predicted, self._copies(0), self.block_bytes,
                                  self.policy.copy_blocks)
            self.cache.link.units(self.num, self.block_bytes, "prefetch", self.policy.copy_blocks)
            self.ready[0].record(self.stream)
        predicted.record_stream(self.stream)
        self.schedule.plan_made(0)

    def _predict_on_side(self, row: int, z: torch.Tensor) -> Prediction:
        """Layer ``row``'s prediction by its router from the previous layer's router input ``z``, made on P."""
        main = torch.cuda.current_stream()
        z = z.clone()  # exllamav3 may reuse the router input's buffer in the next layer, while P still reads it
        self.stream.wait_stream(main)  # after z was made
        with torch.cuda.stream(self.stream):
            predicted = self._router_prediction(row, z)
        z.record_stream(self.stream)  # the compute stream may reuse z's memory only once P has read it
        return predicted

    def after_layer(self, row: int) -> None:
        """Once layer ``row``'s experts are launched (any forward: nothing happens where ``routed`` was not called)."""
        end = self.schedule.layer_end(row)
        if self.schedule.planned[row]:
            if end.picks is None:  # the layer ran without its routing seen (cannot happen within one decode forward)
                torch.cuda.current_stream().wait_event(self.ready[row])
            self.kernels.prefetch_release(self.cache.state, self.state, row, self._no_picks if end.picks is None else end.picks)
            self.schedule.released(row)
        if end.plan is None:
            return
        nxt = row + 1
        if self.budget is not None:
            self.budget.clock.start(nxt)
        self.stream.wait_stream(torch.cuda.current_stream())  # after the release above
        with torch.cuda.stream(self.stream):  # the prediction was made on this stream: it is ready in stream order
            self.kernels.prefetch(self.cache.state, self.state, nxt, end.plan.experts, self._copies(nxt), self.block_bytes,
                                  self.policy.copy_blocks, end.plan.scores, self._min_score(end.plan.scores))
            self.cache.link.units(self.num, self.block_bytes, "prefetch", self.policy.copy_blocks)
            self.ready[nxt].record(self.stream)
        self.schedule.plan_made(nxt)

    def _router_prediction(self, row: int, z: torch.Tensor) -> Prediction:
        """Layer ``row``'s likeliest picks by its router (int64 [rows, top_k + extra], best first), with their float32
        scores, ``prefetch_policy.prediction``'s, where a threshold reads them."""
        top = router_prediction(self.routers[row], z, self.top_k + self.extra)
        return Prediction(top.indices, None if self.min_score is None else top.values.contiguous())

    def _copies(self, row: int) -> int:
        return self.slots if self.budget is None else self.budget.copies(row, self.slots)

    def _min_score(self, scores: torch.Tensor | None) -> float:
        return float("-inf") if scores is None or self.min_score is None else self.min_score

    # ---- measurements

    def record(self) -> None:
        """Keep every decode routing call's true picks from now on (the oracle's first pass)."""
        self.schedule.record()

    def replay(self, picks: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Prefetch exactly ``picks`` (a recorded run's, :meth:`recorded`) from now on, in routing-call order; None
        goes back to the predictor. Returns the picks it replays."""
        return self.schedule.replay(picks)

    def recorded(self) -> list[torch.Tensor]:
        return self.schedule.recorded()

    def stats(self) -> dict:
        totals = self.counters.sum(dim=0).tolist()
        per_layer = self.counters.tolist()
        return {"slots": self.slots, "extra": self.extra, "predictor": "oracle" if self.schedule.replaying else "router",
                "lead": self.schedule.leads, "min_score": self.min_score,
                **({} if self.budget is None else {"budget": self.budget.stats()}),
                **({} if self.gate is None else {"gate": self.gate.stats()}),
                **dict(zip(PF_COUNTERS, totals)),
                "per_layer": [dict(zip(PF_COUNTERS, row)) for row in per_layer]}


def router_prediction(router: tuple[torch.Tensor, torch.Tensor | None], z: torch.Tensor, count: int):
    """A layer's ``count`` likeliest picks by its ``router`` (gate hidden x experts, correction bias or None) on the
    router input ``z`` of the layer before: ``torch.topk`` of sigmoid(z @ gate) + bias, best first (``.indices``
    int64 [rows, count], ``.values`` the scores)."""
    gate, bias = router
    scores = torch.matmul(z.view(-1, gate.shape[0]).to(gate.dtype), gate).float().sigmoid()
    if bias is not None:
        scores = scores + bias
    return torch.topk(scores, min(count, scores.shape[-1]), dim=-1, sorted=True)


def from_settings(settings, kernels: Kernels, cache: ExpertCache, routers, top_k: int, device: torch.device,
                  policy: Policy | None = None) -> Prefetcher | None:
    """The decode's prefetch as ``GLM53_PREFETCH*`` ask for it, its copy rate measured now where the window budget is on
    (None when prefetch is off). Threshold and budget are off by default: on the H200 host's `trained` traffic both on
    decoded 0.97x exact where both off gave 1.08x (bench/results/2026-12-02-offload-session3-h200.md).

    :param routers: per MoE layer its router, as :class:`Prefetcher` takes them.
    """
    if not settings.prefetch:
        return None
    policy = policy or Policy()
    budget = None
    if settings.prefetch_window_budget:
        copy_gbs = measure_copy_gbs(cache.link, cache.store, policy.copy_blocks)
        budget = CopyBudget(copy_gbs, cache.block_bytes, cache.store.num_layers)
    gate = None if settings.prefetch_min_precision is None else PrecisionGate(cache.store.num_layers, settings.prefetch_min_precision)
    return Prefetcher(kernels, cache, routers, settings.prefetch_slots, settings.prefetch_extra, top_k, device, policy,
                      lead=settings.prefetch_lead, min_score=settings.prefetch_min_score, budget=budget, gate=gate)
