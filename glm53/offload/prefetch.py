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

Only where bytes are read from changes: the output is bit-identical (``tests/gpu/test_offload_exact.py``). A wrong
prediction costs link time that was idle. Not in prefill (staging reads every expert there), not in steps of
several streams (``PREDICT_MAX_ROWS``) and not with the CPU tier, whose split would count a prefetched expert as a
miss. For measurements, :meth:`Prefetcher.record` keeps the
true picks of a run and :meth:`Prefetcher.replay` prefetches exactly them in a second run of the same tokens (the
oracle: what the machinery gives with a perfect predictor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache import ExpertCache, Policy
from .ec_native import PF_COUNTERS, EcPool, Kernels
from .part import Part


# Rows (streams decoded together) up to which the next layer is prefetched: at 4 streams the union of their picks
# is several times a small pool, and both the router's and the oracle's prefetch were 3-4 % slower than exact mode
# (bench/results/2026-12-01-third-session-h200.md); at 1 stream they gained 1-9 %.
PREDICT_MAX_ROWS = 1


class Prefetcher(Part):
    """
    :param routers: per MoE layer (in store order) its router: (gate [hidden, experts] as exllamav3 holds it, the
        selection-only correction bias [experts] or None).
    :param slots: VRAM slots of the pool (the most experts copied ahead of a layer).
    :param extra: experts predicted per token beyond ``top_k``.
    :param max_rows: the most rows (streams) of a step that is prefetched.
    :param lead: prefetch the first MoE layer at each decode step's start (:meth:`decode_start`).
    """

    name = "prefetch"

    def __init__(self, kernels: Kernels, cache: ExpertCache, routers: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                 slots: int, extra: int, top_k: int, device: torch.device, policy: Policy | None = None,
                 max_rows: int = PREDICT_MAX_ROWS, lead: bool = False):
        L = cache.store.num_layers
        if len(routers) != L:
            raise ValueError(f"{len(routers)} routers for {L} MoE layers")
        self.kernels, self.cache, self.device = kernels, cache, device
        self.policy = policy or Policy()
        self.block_bytes = cache.block_bytes
        self.top_k, self.extra, self.slots, self.max_rows = top_k, extra, slots, max_rows
        self.routers = [(gate, None if bias is None else bias.float().to(device)) for gate, bias in routers]
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
        self.planned = [False] * L
        self._picks: list[torch.Tensor | None] = [None] * L  # this forward's, per layer
        self._predictions: list[torch.Tensor | None] = [None] * L  # per layer, made on P for its plan
        self._calls = 0  # routing calls seen (the position in a recorded run)
        self._no_picks = torch.zeros((0,), dtype=torch.int64, device=device)
        self._recording: list[torch.Tensor] | None = None
        self._oracle: list[torch.Tensor] | None = None
        self.leads = lead
        self._last_first: torch.Tensor | None = None  # the last decode step's picks of the first MoE layer (lead's prediction)

    # ---- hooks (the offload's, ``part.Part``: on the compute stream, decode forwards only for routed)

    def forward_start(self) -> None:
        """Before a forward: a plan left from a forward that stopped before its layer (an error) is waited for and
        released, so that no table points into the pool outside the layer it was planned for."""
        for row, planned in enumerate(self.planned):
            if planned:
                torch.cuda.current_stream().wait_event(self.ready[row])
                self.kernels.prefetch_release(self.cache.state, self.state, row, self._no_picks)
                self.planned[row] = False
        self._picks = [None] * len(self._picks)
        self._predictions = [None] * len(self._predictions)

    def routed(self, row: int, selected: torch.Tensor, weights: torch.Tensor | None, z: torch.Tensor) -> None:
        """After layer ``row``'s routing, before the cache's step. Only a step of at most ``max_rows`` rows has the
        next layer predicted (from the router's input ``z``; the weights are not needed)."""
        if self.planned[row]:
            torch.cuda.current_stream().wait_event(self.ready[row])
        self._picks[row] = selected
        if row == 0 and self.leads and self._oracle is None:
            self._last_first = selected.clone()  # exllamav3 reuses the buffer; the next step's lead reads it on P
        if self._recording is not None:
            self._recording.append(selected.clone())
        self._calls += 1  # the oracle's index of the next routing call: layer row + 1's
        nxt = row + 1
        if selected.shape[0] <= self.max_rows and nxt < len(self.routers):
            self._predictions[nxt] = self._predict_on_side(nxt, z)

    def decode_start(self, rows: int) -> None:
        """Before a decode forward of ``rows`` rows (after :meth:`forward_start`): the first MoE layer's prefetch, planned and
        copied on P now, from the previous step's picks of that layer when it had as many rows (the oracle's: this
        step's true picks)."""
        if not self.leads or rows > self.max_rows:
            return
        predicted = self._oracle_picks() if self._oracle is not None else self._last_first
        if predicted is None or predicted.shape[0] != rows:
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # after the last step's picks were copied and the pool released
        with torch.cuda.stream(self.stream):
            self.kernels.prefetch(self.cache.state, self.state, 0, predicted, self.slots, self.block_bytes, self.policy.copy_blocks)
            self.cache.link.units(self.num, self.block_bytes, "prefetch", self.policy.copy_blocks)
            self.ready[0].record(self.stream)
        predicted.record_stream(self.stream)
        self.planned[0] = True

    def _predict_on_side(self, row: int, z: torch.Tensor) -> torch.Tensor | None:
        """Layer ``row``'s prediction from the previous layer's router input ``z``, made on P (the oracle's: the
        recorded true picks of this routing call, nothing to compute)."""
        if self._oracle is not None:
            return self._oracle_picks()
        main = torch.cuda.current_stream()
        z = z.clone()  # exllamav3 may reuse the router input's buffer in the next layer, while P still reads it
        self.stream.wait_stream(main)  # after z was made
        with torch.cuda.stream(self.stream):
            predicted = self._router_prediction(row, z)
        z.record_stream(self.stream)  # the compute stream may reuse z's memory only once P has read it
        return predicted

    def _oracle_picks(self) -> torch.Tensor | None:
        """The recorded true picks of the next routing call (None past the recorded run)."""
        return self._oracle[self._calls] if self._calls < len(self._oracle) else None

    def after_layer(self, row: int) -> None:
        """Once layer ``row``'s experts are launched (any forward: nothing happens where ``routed`` was not called)."""
        picks = self._picks[row]
        self._picks[row] = None
        if self.planned[row]:
            if picks is None:  # the layer ran without its routing seen (cannot happen within one decode forward)
                torch.cuda.current_stream().wait_event(self.ready[row])
            self.kernels.prefetch_release(self.cache.state, self.state, row, self._no_picks if picks is None else picks)
            self.planned[row] = False
        nxt = row + 1
        predicted = self._predictions[nxt] if nxt < len(self._predictions) else None
        if predicted is None:
            return
        self._predictions[nxt] = None
        self.stream.wait_stream(torch.cuda.current_stream())  # after the release above
        with torch.cuda.stream(self.stream):  # the prediction was made on this stream: it is ready in stream order
            self.kernels.prefetch(self.cache.state, self.state, nxt, predicted, self.slots, self.block_bytes,
                                  self.policy.copy_blocks)
            self.cache.link.units(self.num, self.block_bytes, "prefetch", self.policy.copy_blocks)
            self.ready[nxt].record(self.stream)
        self.planned[nxt] = True

    def _router_prediction(self, row: int, z: torch.Tensor) -> torch.Tensor:
        """int64 [rows, top_k + extra]: layer ``row``'s likeliest picks by its router, best first."""
        gate, bias = self.routers[row]
        scores = torch.matmul(z.view(-1, gate.shape[0]).to(gate.dtype), gate).float().sigmoid()
        if bias is not None:
            scores = scores + bias
        return torch.topk(scores, min(self.top_k + self.extra, scores.shape[-1]), dim=-1, sorted=True).indices

    # ---- measurements

    def record(self) -> None:
        """Keep every decode routing call's true picks from now on (the oracle's first pass)."""
        self._recording, self._oracle, self._calls = [], None, 0

    def replay(self, picks: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Prefetch exactly ``picks`` (a recorded run's, :meth:`recorded`) from now on, in routing-call order; None
        goes back to the predictor. Returns the picks it replays."""
        self._oracle = None if picks is None else list(picks)
        self._recording, self._calls = None, 0
        return self._oracle or []

    def recorded(self) -> list[torch.Tensor]:
        return list(self._recording or [])

    def stats(self) -> dict:
        totals = self.counters.sum(dim=0).tolist()
        per_layer = self.counters.tolist()
        return {"slots": self.slots, "extra": self.extra, "predictor": "oracle" if self._oracle is not None else "router",
                "lead": self.leads,
                **dict(zip(PF_COUNTERS, totals)),
                "per_layer": [dict(zip(PF_COUNTERS, row)) for row in per_layer]}
