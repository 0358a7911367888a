"""The CPU tier's handoff, host side (``native/cpu_tier``): a job ring, the expert table and the host worker.

Per MoE layer and decode step a producer (a GPU kernel, ``device.DeviceProducer``; the tests' host stand-in calls
the library's reference producer) publishes a job into the ring: the cold missed experts of the layer for 1..8 tokens as picks (token,
expert, router weight) plus the fp16 input rows. The :class:`Worker` (one host thread, the expert kernel on a
``kernel.Pool``) computes ``out[t] = sum w * expert(x[t])`` in fp32 and publishes it. A producer whose
deadline passes takes the job back and computes it itself; exactly one side contributes every job.
``native/cpu_tier/cpu_tier.h`` documents the byte layout and the state machine.

The worker finds experts through a table registered once: the trellises are read where the host store holds them
(the single host copy); ``suh``/``svh`` are the CPU tier's own fp16 copies (exllamav3 keeps its in VRAM).

Here the ring is plain page-aligned host memory; registering it with CUDA as mapped memory is the device side's
business (not imported here).
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np

from ..native import abi
from ..native.cpu import library
from ..native.cpu_binding import glm53_ce_expert, glm53_ct_counters, glm53_ct_layout, glm53_ct_state
from . import kernel as ce

STATES = abi.names(glm53_ct_state, "GLM53_CT_")  # by id: empty, published, claimed, done, failed, taken_back, skipped
PROJECTIONS = ("gate", "up", "down")
COUNTERS = tuple(name for name, _ in glm53_ct_counters._fields_)


def _check(rc: int) -> None:
    if rc < 0:
        raise ce.KernelError(library().glm53_ct_error().decode())


@dataclass(frozen=True)
class Layout:
    """Byte offsets of a ring (see cpu_tier.h): slot i at ``slots_offset + i * slot_bytes``; inside a slot the
    header line at 0, picks, x (fp16 [max_tokens, hidden]) and out (fp32 [max_tokens, hidden])."""

    slots: int
    hidden: int
    max_tokens: int
    max_picks: int
    slot_bytes: int
    slots_offset: int
    picks_offset: int
    x_offset: int
    out_offset: int
    total_bytes: int


def ring_layout(slots: int, hidden: int, max_tokens: int = 8, max_picks: int = 8) -> Layout:
    c = glm53_ct_layout()
    _check(library().glm53_ct_ring_layout(slots, hidden, max_tokens, max_picks, ctypes.byref(c)))
    return Layout(*(getattr(c, n) for n in ("slots", "hidden", "max_tokens", "max_picks", "slot_bytes", "slots_offset",
                                             "picks_offset", "x_offset", "out_offset", "total_bytes")))


class Ring:
    """A job ring in page-aligned anonymous host memory (not registered with CUDA)."""

    def __init__(self, slots: int, hidden: int, max_tokens: int = 8, max_picks: int = 8) -> None:
        self.layout = ring_layout(slots, hidden, max_tokens, max_picks)
        self._map = mmap.mmap(-1, self.layout.total_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.bytes = np.frombuffer(self._map, np.uint8)
        self.address = self.bytes.ctypes.data
        _check(library().glm53_ct_ring_init(self.address, self.layout.total_bytes, slots, hidden, max_tokens, max_picks))

    def word(self, slot: int) -> tuple[int, str]:
        """(sequence number, state) of a slot's JOB word (the producer's: published, taken_back)."""
        w = library().glm53_ct_slot_word(self.address, slot, 0)
        return w >> 8, STATES[w & 0xFF]

    def ack(self, slot: int) -> tuple[int, str]:
        """(sequence number, state) of a slot's ACK word (the worker's: claimed, done, failed, skipped)."""
        w = library().glm53_ct_slot_word(self.address, slot, 1)
        return w >> 8, STATES[w & 0xFF]

    def free(self, slot: int) -> bool:
        """Whether a producer may publish into the slot (the worker has finished with its last job)."""
        (j, _), (a, state) = self.word(slot), self.ack(slot)
        return j == 0 or (a == j and state in ("done", "failed", "skipped"))

    def worker_next(self) -> int:
        return int(self.bytes[128:136].view(np.uint64)[0])

    def x(self, slot: int, tokens: int) -> np.ndarray:
        """A view of a slot's fp16 input rows (what the worker computes on)."""
        L = self.layout
        at = L.slots_offset + slot * L.slot_bytes + L.x_offset
        return self.bytes[at : at + 2 * tokens * L.hidden].view(np.float16).reshape(tokens, L.hidden)

    def out(self, slot: int, tokens: int) -> np.ndarray:
        """A view of a slot's fp32 output rows."""
        L = self.layout
        at = L.slots_offset + slot * L.slot_bytes + L.out_offset
        return self.bytes[at : at + 4 * tokens * L.hidden].view(np.float32).reshape(tokens, L.hidden)


class ExpertTable:
    """Per (layer row, expert) the addresses of the three trellises and six fp16 sign/scale vectors, registered with
    the worker once. Keeps what it points to alive."""

    def __init__(self, experts: Mapping[tuple[int, int], Sequence[ce.Linear]], num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._keep: list = []
        self.c = (glm53_ce_expert * (num_layers * num_experts))()  # unregistered entries stay NULL
        for (row, e), (gate, up, down) in experts.items():
            if not (0 <= row < num_layers and 0 <= e < num_experts):
                raise ValueError(f"expert ({row}, {e}) outside {num_layers} layers x {num_experts} experts")
            self.c[row * num_experts + e] = glm53_ce_expert(*(ce._c_linear(lin, f"experts[{row}, {e}].{p}", self._keep)
                                                          for p, lin in zip(PROJECTIONS, (gate, up, down))))


def host_store_experts(store, sign_scale: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[tuple[int, int], tuple[ce.Linear, ...]]:
    """``{(layer row, expert): (gate, up, down)}`` over a loaded host store: the trellises are views of its arenas
    (the single host copy), ``sign_scale`` per projection name fp16 ``(suh [layers, experts, in], svh [layers,
    experts, out])``, the CPU tier's own copies (``HostStore.read_sign_scale``). The store must outlive them."""
    b = store.layout.block_bytes
    return {(row, e): expert_linears(store.layout, store.arenas[row].numpy(), e * b, sign_scale, row, e)
            for row in range(store.num_layers) for e in range(store.num_experts)}


def expert_linears(layout, arena: np.ndarray, base: int, sign_scale: Mapping[str, tuple[np.ndarray, np.ndarray]], row: int,
                   e: int) -> tuple[ce.Linear, ...]:
    """Expert ``e`` of layer ``row`` whose block (the host store's ``layout``) starts at byte ``base`` of ``arena``
    (uint8): its trellises are views there, its sign/scale vectors ``sign_scale``'s (as :func:`host_store_experts`)."""
    lins = []
    for p, name in enumerate(PROJECTIONS):
        at = base + layout.offsets[p]
        trellis = arena[at : at + layout.nbytes[p]].view(np.int16).reshape(layout.shapes[p])
        suh, svh = sign_scale[name]
        lins.append(ce.Linear(trellis, suh[row, e], svh[row, e]))
    return tuple(lins)


class ArenaExperts:
    """The experts as the CPU tier reads them beside a RAM tier (``glm53.offload.ram_tier.RamTier``: its ``arena`` and
    ``host_address``): each where its ``home`` (the device address of a block in the tier's arena) is. ``experts``
    is the table to start from (``home_host``: int64 [layers, experts]); :meth:`trellises` gives the addresses a
    worker is re-pointed to when the RAM tier's part moves an expert (``Worker.repoint``). An expert's bytes are
    at its ``home`` only while the tier holds it there: the part reads every pick there before its layer's job."""

    def __init__(self, store, ram_tier, home_host: np.ndarray, sign_scale: Mapping[str, tuple[np.ndarray, np.ndarray]]):
        self.ram_tier = ram_tier
        self.offsets = np.array(store.layout.offsets, dtype=np.int64)  # gate, up, down in a block
        at = ram_tier.host_address(home_host) - ram_tier.arena.ctypes.data
        self.experts = {(row, e): expert_linears(store.layout, ram_tier.arena, int(at[row, e]), sign_scale, row, e)
                        for row in range(store.num_layers) for e in range(store.num_experts)}

    def trellises(self, addresses: np.ndarray) -> np.ndarray:
        """int64 [n, 3]: the gate, up and down trellises' host addresses in the blocks at device ``addresses``."""
        return self.ram_tier.host_address(addresses)[:, None] + self.offsets[None, :]


class Worker:
    """The host thread that serves a ring. ``pool``: a started ``kernel.Pool`` (None: this thread alone).
    ``cpu``: pin the worker thread (None: not pinned); it should have a core of its own, since it takes part in
    the pool's work. Between :meth:`wake` (a decode step starts) and :meth:`rest` (it is over) it never naps: the
    GPU publishes a layer's job with no notice, and one that found it napping would wait out the nap. Otherwise,
    idle, it spins ``spin_us`` after its last job (or wake or rest), then naps, 50 us doubling up to ``nap_us``;
    idle for ``park_us`` (0: never) it parks, asleep until :meth:`wake` (and a look at the ring every 100 ms).
    ``codebook``: ``kernel.CODEBOOKS``."""

    def __init__(self, ring: Ring, table: ExpertTable, *, act_limit: float, pool: ce.Pool | None = None,
                 isa: str | None = None, cpu: int | None = None, spin_us: int = 2000, nap_us: int = 1000,
                 park_us: int = 0, codebook: str = "fp16") -> None:
        ce.codebook_id(codebook)  # a bad name fails here, not at start()
        self.ring, self.table, self.pool = ring, table, pool
        self.act_limit, self.isa, self.cpu, self.spin_us, self.nap_us = act_limit, isa, cpu, spin_us, nap_us
        self.park_us = park_us
        self.codebook = codebook
        self.handle: int | None = None

    def start(self) -> Self:
        if self.handle is None:
            handle = library().glm53_ct_worker_start(
                self.ring.address, self.table.c, self.table.num_layers, self.table.num_experts, float(self.act_limit),
                self.pool.handle if self.pool is not None else None, ce._isa_id(self.isa), ce.codebook_id(self.codebook),
                -1 if self.cpu is None else self.cpu, self.spin_us, self.nap_us, self.park_us)
            if not handle:
                raise ce.KernelError(library().glm53_ct_error().decode())
            self.handle = handle
        return self

    def stop(self) -> None:
        """Returns once the worker thread has exited (a claimed job is finished and published first)."""
        if self.handle is not None:
            library().glm53_ct_worker_stop(self.handle)
            self.handle = None

    def repoint(self, row: int, experts: np.ndarray, trellises: np.ndarray) -> None:
        """Point the trellises of layer ``row``'s ``experts`` (ids registered in the table) at ``trellises`` (int64
        ``[n, 3]``: gate, up and down host addresses), where a RAM tier moved their bytes: the worker's jobs read
        them there from the next job that takes them. Each address must stay mapped for the worker's life (a job
        taken back after its claim may still read an old one; its result is discarded). The table this worker
        started from is not changed (the worker keeps its own copy).

        :raise KernelError: an expert not registered, or a zero address (nothing was changed).
        """
        entries = np.ascontiguousarray(row * self.table.num_experts + np.asarray(experts, dtype=np.int64), dtype=np.int64)
        addresses = np.ascontiguousarray(trellises, dtype=np.uint64).reshape(-1)
        if addresses.size != 3 * entries.size:
            raise ValueError(f"{entries.size} experts need {3 * entries.size} trellis addresses, got {addresses.size}")
        if self.handle is None:
            raise RuntimeError("the worker is not running: start it before re-pointing its table")
        _check(library().glm53_ct_worker_repoint(self.handle, entries.ctypes.data, addresses.ctypes.data, entries.size))

    def wake(self) -> None:
        """A decode step is about to start: a napping or parked worker spins again, and naps no more until
        :meth:`rest` (or a second after the wake-up, should rest never come)."""
        if self.handle is not None:
            library().glm53_ct_worker_wake(self.handle)

    def rest(self) -> None:
        """The decode step is over: the worker spins ``spin_us`` more, then naps and parks as when idle."""
        if self.handle is not None:
            library().glm53_ct_worker_rest(self.handle)

    def parked(self) -> bool:
        return self.handle is not None and bool(library().glm53_ct_worker_parked(self.handle))

    def counters(self) -> dict[str, int | float]:
        c = glm53_ct_counters()
        if self.handle is not None:
            library().glm53_ct_worker_counters(self.handle, ctypes.byref(c))
        out: dict[str, int | float] = {n: int(getattr(c, n)) for n in COUNTERS}
        out["busy_s"] = out.pop("busy_ns") / 1e9
        return out

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
