"""The CPU tier's handoff, GPU side: :class:`DeviceProducer` publishes jobs into a :class:`~glm53.cpu_tier.worker.Ring`
from CUDA kernels and collects the host worker's fp32 partials, with no host synchronisation.

The ring's host memory is registered with CUDA as mapped memory; the kernels (``native/ec/cpu_tier_device.cuh``)
follow the protocol of ``native/cpu_tier/cpu_tier.h``: payload stores, a system-scope fence and a release store of
the JOB word to publish; an acquire load of the worker's ACK word to see DONE; past the deadline a release store of
JOB = TAKEN_BACK (no atomics cross the link: each word has one writer). All of it runs in stream order on the
current torch stream:

    status = producer.publish(layer, x, picks)      # x fp16 [T, hidden] on the GPU, picks from pack_picks
    ... the GPU computes the layer's other experts meanwhile ...
    outcome = producer.collect(status, acc, timeout_s)  # acc fp32 [T, hidden] += the partial when DONE

``outcome`` (a device int32) says whether the partial was added ("done"); otherwise ("none": not published,
"failed", "taken_back_*") the caller must compute the job's experts itself: :meth:`DeviceProducer.fallback_plan`
turns a split's record and the outcome into the sorted picks of exllamav3's fused expert kernel, empty unless the
job was published and not delivered, so the GPU computes exactly the experts the host did not. The numbers of each
are in :meth:`DeviceProducer.stats`. Jobs are collected in the order they were published, at most one per ring slot
outstanding (a slot's out must not be overwritten before it is read); shadow jobs (probes) are not collected. One
producer per ring.

The kernels are in the project's CUDA library (``glm53.native.cuda``); ``struct CtRing``, the outcomes, counters and
limits below and the signatures are ``glm53.native.cuda_binding``'s (generated from ``native/ec/expert_cache.h`` and
checked against the library when it loads).
"""

from __future__ import annotations

import ctypes
from collections import deque
from pathlib import Path

import torch

from ..native import abi, cuda
from ..native.cuda_binding import CT_N, CT_RECORD, CT_SPLIT_MAX_PICKS, CtRing, ct_counter, ct_outcome
from .worker import Ring

OUTCOMES = abi.names(ct_outcome, "CT_OUT_")  # by id: none, done, failed, taken_back_before_claim, taken_back_after_claim
COUNTERS = abi.names(ct_counter, "CT_C_", "CT_N")  # by id: published, busy, done, failed, taken_back_*, wait_ns, ...
CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
SPLIT_MAX_PICKS = CT_SPLIT_MAX_PICKS  # tokens * top-k of one decode step
ADD_BLOCKS = 16  # blocks reading a partial over the link (16 already reach the link's rate, see bench/bandwidth.py)


class CtKernels:
    """The CPU tier's device-side kernels (``ct_*`` of the project's CUDA library, beside the expert cache's)."""

    counter_count, record_size = CT_N, CT_RECORD  # int64 counters the kernels keep, int32 entries of a split's record

    def __init__(self, path: Path | None = None):
        """:param path: the library (default: ``glm53.native.cuda.locate``'s).
        :raise NativeBuildError: no library found or built. :raise AbiMismatch: its ``CtRing``, outcomes, counters,
            limits or functions are not the binding's (a stale build)."""
        self._lib, self.path = cuda.library(path)

    def _check(self, code: int) -> None:
        cuda.checked(self._lib, code)

    def device_pointer(self, host_address: int) -> tuple[int, bool]:
        """(device address of registered host memory, whether the link does atomics on host memory natively)."""
        dev, native = ctypes.c_void_p(), ctypes.c_int(0)
        self._check(self._lib.ct_device_pointer(ctypes.c_void_p(host_address), ctypes.byref(dev), ctypes.byref(native)))
        return int(dev.value), bool(native.value)

    def publish(self, ring: CtRing, next_seq: torch.Tensor, layer: int, x: torch.Tensor, picks: torch.Tensor,
                status: torch.Tensor, counters: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ct_publish(ctypes.byref(ring), next_seq.data_ptr(), layer, x.shape[0], picks.data_ptr(),
                                         picks.shape[0], x.data_ptr(), status.data_ptr(), counters.data_ptr(), stream))

    def collect(self, ring: CtRing, status: torch.Tensor, timeout_ns: int, outcome: torch.Tensor, acc: torch.Tensor,
                add_blocks: int, counters: torch.Tensor, info: torch.Tensor | None = None, per_expert_ns: int = 0,
                floor_ns: int = 0) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ct_collect(ctypes.byref(ring), status.data_ptr(), timeout_ns,
                                         None if info is None else info.data_ptr(), per_expert_ns, floor_ns, outcome.data_ptr(),
                                         acc.data_ptr(), acc.shape[0], add_blocks, counters.data_ptr(), stream))

    def split_publish(self, ring: CtRing, next_seq: torch.Tensor, layer: int, sel: torch.Tensor, rw: torch.Tensor,
                      y: torch.Tensor, slot_of: torch.Tensor, freq: torch.Tensor, table: torch.Tensor, probe_k: int,
                      status: torch.Tensor, counters: torch.Tensor, info: torch.Tensor, record: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        T, topk = sel.shape
        self._check(self._lib.ct_split_publish(
            ctypes.byref(ring), next_seq.data_ptr(), layer, T, topk, sel.data_ptr(), rw.data_ptr(), y.data_ptr(),
            slot_of.data_ptr(), freq.data_ptr(), table.data_ptr(), table.shape[0] - 1, table.shape[1] - 1, probe_k,
            status.data_ptr(), counters.data_ptr(), info.data_ptr(), record.data_ptr(), stream))

    def fallback_plan(self, status: torch.Tensor, outcome: torch.Tensor, record: torch.Tensor, n: int, topk: int,
                      count: torch.Tensor, token_sorted: torch.Tensor, weight_sorted: torch.Tensor,
                      counters: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ct_fallback_plan(
            status.data_ptr(), outcome.data_ptr(), record.data_ptr(), n, topk, count.shape[0] - 1, count.data_ptr(),
            token_sorted.data_ptr(), weight_sorted.data_ptr(), counters.data_ptr(), stream))


def pack_picks(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Picks as the ring stores them: int32 [n, 3] of (token, expert, the fp32 weight's bits)."""
    return torch.stack([tokens.to(torch.int32), experts.to(torch.int32), weights.to(torch.float32).view(torch.int32)], dim=1).contiguous()


class DeviceProducer:
    """Publishes and collects jobs of one ring from the GPU ``device``. The ring must outlive it (``close`` first)."""

    def __init__(self, ring: Ring, device: torch.device, kernels: CtKernels | None = None):
        self.ring, self.device = ring, device
        self.kernels = kernels or CtKernels()
        cudart = torch.cuda.cudart()
        L = ring.layout
        err = int(cudart.cudaHostRegister(ring.address, L.total_bytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of the CPU tier's {L.total_bytes} byte ring failed (CUDA error {err})")
        self._unregister = lambda: cudart.cudaHostUnregister(ring.address)
        base, self.native_host_atomics = self.kernels.device_pointer(ring.address)
        self.c = CtRing(base, L.slots, L.hidden, L.max_tokens, L.max_picks, L.slot_bytes, L.slots_offset, L.picks_offset,
                        L.x_offset, L.out_offset)
        self.next_seq = torch.ones(1, dtype=torch.int64, device=device)  # the next job's number (1, 2, ...)
        self.counters = torch.zeros(self.kernels.counter_count, dtype=torch.int64, device=device)
        self._plans: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # num_experts -> plan buffers
        self._outstanding: deque[torch.Tensor] = deque()  # statuses published and not yet collected, oldest first

    def publish(self, layer: int, x: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        """Publish the job; returns its number as a device int64 [1] (0: not published, compute it yourself)."""
        if x.dtype != torch.float16 or x.dim() != 2 or x.shape[1] != self.ring.layout.hidden or not x.is_contiguous():
            raise ValueError(f"x must be contiguous fp16 [tokens, {self.ring.layout.hidden}], not {x.dtype} {tuple(x.shape)}")
        if picks.dtype != torch.int32 or picks.dim() != 2 or picks.shape[1] != 3:
            raise ValueError("picks must be int32 [n, 3] (pack_picks)")
        status = self._next_status()
        self.kernels.publish(self.c, self.next_seq, layer, x, picks, status, self.counters)
        return status

    def split_publish(self, layer: int, sel: torch.Tensor, rw: torch.Tensor, y: torch.Tensor, slot_of: torch.Tensor,
                      freq: torch.Tensor, table: torch.Tensor, probe_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fast mode's split of one decode step's routing (``split.split_reference`` says what it does): publishes
        the coldest missed experts' picks with the rows ``y`` and zeroes their weights in ``rw`` in place (the
        GPU's kernels then skip them). Returns (status as :meth:`publish`, int32 [4] hits / misses / experts /
        picks sent, the record of the picks moved for :meth:`fallback_plan`).

        ``probe_k > 0``: a shadow job of the ``probe_k`` coldest misses instead, whatever the table says, that only
        times the host: no weight is zeroed, nothing is recorded, and it is not collected (counted as a probe).

        :param sel: int64 ``[T, topk]``; ``rw``: fp16 ``[T, topk]`` (exllamav3's routing tensors, contiguous);
            ``y``: fp16 ``[T, hidden]``; ``slot_of``: int32 ``[E]``; ``freq``: float32 ``[E]``;
            ``table``: uint8 ``Costs.table`` on the device.
        """
        if sel.dtype != torch.int64 or rw.dtype != torch.float16 or sel.shape != rw.shape or sel.dim() != 2 \
                or sel.numel() > SPLIT_MAX_PICKS or not (sel.is_contiguous() and rw.is_contiguous()):
            raise ValueError(f"sel must be int64 and rw fp16, both contiguous [T, topk] with T * topk <= {SPLIT_MAX_PICKS}")
        if y.dtype != torch.float16 or tuple(y.shape) != (sel.shape[0], self.ring.layout.hidden) or not y.is_contiguous():
            raise ValueError(f"y must be contiguous fp16 [{sel.shape[0]}, {self.ring.layout.hidden}]")
        if slot_of.dtype != torch.int32 or freq.dtype != torch.float32 or table.dtype != torch.uint8 or table.dim() != 3:
            raise ValueError("slot_of must be int32, freq float32 and table a uint8 [tokens, experts, experts] cube")
        status = self._next_status(collected=probe_k <= 0)
        info = torch.empty(4, dtype=torch.int32, device=self.device)  # the kernel writes all four (no memset launch)
        record = torch.empty(self.kernels.record_size, dtype=torch.int32, device=self.device)
        self.kernels.split_publish(self.c, self.next_seq, layer, sel, rw, y, slot_of, freq, table, max(probe_k, 0),
                                   status, self.counters, info, record)
        return status, info, record

    def fallback_plan(self, status: torch.Tensor, outcome: torch.Tensor, record: torch.Tensor, tokens: int, topk: int,
                      num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After :meth:`collect`: the picks the GPU must compute itself, sorted for exllamav3's fused expert kernel
        (``exl3_moe``): (int64 [num_experts + 1] picks per expert, the last bin the rest; int64 [tokens * topk]
        their tokens; fp16 [tokens * topk] their weights). Every pick is in the last bin unless the job was published
        and not delivered. The buffers are reused by the next call (same stream: the kernel that reads them runs
        first)."""
        n = tokens * topk
        if num_experts not in self._plans:
            self._plans[num_experts] = (torch.zeros(num_experts + 1, dtype=torch.int64, device=self.device),
                                        torch.zeros(SPLIT_MAX_PICKS, dtype=torch.int64, device=self.device),
                                        torch.zeros(SPLIT_MAX_PICKS, dtype=torch.float16, device=self.device))
        count, token_sorted, weight_sorted = self._plans[num_experts]
        self.kernels.fallback_plan(status, outcome, record, n, topk, count, token_sorted, weight_sorted, self.counters)
        return count, token_sorted[:n], weight_sorted[:n]

    def _next_status(self, collected: bool = True) -> torch.Tensor:
        """The device word a publish writes its job number to, queued for collection in publish order (at most one
        job per slot outstanding: a slot's out must not be overwritten before it is read)."""
        if len(self._outstanding) >= self.ring.layout.slots:
            raise RuntimeError(f"{len(self._outstanding)} jobs outstanding on a ring of {self.ring.layout.slots} slots: collect the oldest first")
        status = torch.empty(1, dtype=torch.int64, device=self.device)
        if collected:
            self._outstanding.append(status)
        return status

    def collect(self, status: torch.Tensor, acc: torch.Tensor, timeout_s: float, info: torch.Tensor | None = None,
                per_expert_s: float = 0.0, floor_s: float = 0.0) -> torch.Tensor:
        """Wait for the job up to ``timeout_s`` (then take it back); when it is DONE add its partial into ``acc``
        (fp32 [tokens, hidden], the job's rows) and free the slot. With a split's ``info``, the wait is a stop-loss:
        at most ``per_expert_s`` for each expert the job holds (at least ``floor_s``). Returns the outcome as a device
        int32 [1] (an index into ``OUTCOMES``)."""
        if acc.dtype != torch.float32 or acc.dim() != 2 or acc.shape[1] != self.ring.layout.hidden or not acc.is_contiguous():
            raise ValueError(f"acc must be contiguous fp32 [tokens, {self.ring.layout.hidden}]")
        if not self._outstanding or self._outstanding[0] is not status:
            raise RuntimeError("jobs are collected in the order they were published")
        self._outstanding.popleft()
        outcome = torch.empty(1, dtype=torch.int32, device=self.device)
        self.kernels.collect(self.c, status, int(timeout_s * 1e9), outcome, acc, ADD_BLOCKS, self.counters, info,
                             int(per_expert_s * 1e9), int(floor_s * 1e9))
        return outcome

    def stats(self) -> dict[str, int | float | bool]:
        """Counters (synchronises with the device)."""
        values = dict(zip(COUNTERS, self.counters[: len(COUNTERS)].tolist()))
        values["wait_s"] = values.pop("wait_ns") / 1e9
        values["native_host_atomics"] = self.native_host_atomics
        return values

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._unregister()
