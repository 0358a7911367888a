"""The CPU tier's test scaffolding: a host stand-in for the GPU producer, the worker's hold hook and an expert table
over a whole host store. The library's reference producer functions (``glm53_ct_producer_*``) and its test hook
(``glm53_ct_worker_debug_hold``) are called here only (their signatures are ``glm53.native.cpu_binding``'s)."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from glm53.cpu_tier import worker as ct
from glm53.cpu_tier.worker import ExpertTable, Ring, Worker, host_store_experts
from glm53.native.cpu import library
from glm53.native.cpu_binding import GLM53_CT_EBUSY, glm53_ct_pick


def debug_hold(worker: Worker, hold: bool) -> None:
    """While ``hold``, the worker, having claimed a job, waits before computing it (the library's test hook)."""
    library().glm53_ct_worker_debug_hold(worker.handle, int(hold))


def expert_table(store, sign_scale: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> ExpertTable:
    """Every expert of a loaded host store, its trellises read in place (``host_store_experts``); the table keeps
    the store alive."""
    table = ExpertTable(host_store_experts(store, sign_scale), store.num_layers, store.num_experts)
    table._keep.append(store)
    return table


@dataclass(frozen=True)
class Outcome:
    state: str  # "done", "failed" or "taken_back"
    after_claim: bool = False  # taken back while the worker computed (its result will be discarded)


class HostProducer:
    """What the GPU kernel does, on the host (the library's reference functions): numbers jobs 1, 2, ... in publish
    order, publishes, waits with a deadline and takes back. A job's out stays valid until its slot is published into
    again. Not thread-safe (one producer)."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.next_seq = 1
        self._tokens: dict[int, int] = {}

    def publish(self, layer: int, x: np.ndarray, picks: Sequence[tuple[int, int, float]]) -> int | None:
        """Job number, or None when the ring's next slot is not free (then the caller computes the job itself)."""
        if self.next_seq - self.ring.layout.slots in self._tokens:
            return None  # the slot's previous job is still ours to read (result() or its outcome ends it)
        xa = np.ascontiguousarray(x, dtype=np.float16)
        arr = (glm53_ct_pick * len(picks))(*(glm53_ct_pick(int(t), int(e), float(w)) for t, e, w in picks))
        seq = self.next_seq
        rc = library().glm53_ct_producer_publish(self.ring.address, seq, layer, xa.shape[0], arr, len(picks), xa.ctypes.data)
        if rc == GLM53_CT_EBUSY:
            return None
        ct._check(rc)
        self.next_seq += 1
        self._tokens[seq] = xa.shape[0]
        return seq

    def _outcome(self, rc: int, after: ctypes.c_int32) -> Outcome:
        ct._check(rc)
        return Outcome(ct.STATES[rc], bool(after.value) if ct.STATES[rc] == "taken_back" else False)

    def _finish(self, seq: int, outcome: Outcome) -> Outcome:
        if outcome.state != "done":  # nothing to read
            self._tokens.pop(seq, None)
        return outcome

    def wait(self, seq: int, timeout_s: float | None) -> Outcome:
        """Waits for job seq up to timeout_s (None: forever), then takes it back."""
        after = ctypes.c_int32(0)
        timeout_us = -1 if timeout_s is None else int(timeout_s * 1e6)
        return self._finish(seq, self._outcome(library().glm53_ct_producer_wait(self.ring.address, seq, timeout_us, ctypes.byref(after)), after))

    def take_back(self, seq: int) -> Outcome:
        after = ctypes.c_int32(0)
        return self._finish(seq, self._outcome(library().glm53_ct_producer_take_back(self.ring.address, seq, ctypes.byref(after)), after))

    def result(self, seq: int) -> np.ndarray:
        """A copy of a DONE job's output."""
        return self.ring.out(seq % self.ring.layout.slots, self._tokens.pop(seq)).copy()
