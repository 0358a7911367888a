"""The host link as the offload uses it: its rates measured on the running machine, and its in-band emulation of a
slower link for measurements (``GLM53_LINK_EMULATE_GBS``; off by default).

Every part that moves expert bytes from the host to the GPU tells :class:`Link` what it moved, on the stream it moved
it on: the decode's and prefill's zero-copy misses (``misses``, after routing, the CPU tier's split and the cache's
step, when the layer's pointer tables say what is read from the host store), the CPU tier's GPU fallback
(``fallback``), the cache's admissions and prefetch's copies (``units``: counts known only on the device), the CPU
tier's job inputs and results (``tier_io``), copy-engine copies (``copied``: staging, the elastic loan's return) and
the start-up read probes (``probed``). On the full link it does nothing. Emulating a link of W_target GB/s, each
transfer of B bytes is followed on its stream by a GPU-side hold of B x (1/W_target - 1/W_measured)
(``native/ec/link_emulate.cuh``): what waits for the transfer waits as long as on the slower link, with no extra
link, DRAM or host-core load. W_measured is this machine's rate, measured at start for both kinds of transfer:
SM-issued reads of mapped host memory (a full grid of the expert cache's read probe) and copy-engine copies.

Everything the offload and the CPU tier measure at start goes through the link (the tier's link figure included),
so the split's costs are the emulated link's without being told. Held bytes and time are counted per kind on the
device (``/stats``: ``offload.link``).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import torch

from .ec_native import LINK_KINDS, EcState, Kernels, LeLink

log = logging.getLogger(__name__)

PROBE_BYTES = 1 << 28  # read or copied by each start-up measurement (256 MiB: past the L2 and any TLB effect)
ABOVE_MEASURED = 1.05  # a target this much above the measured rate is refused (an emulation only slows the link)
KIND = {name: i for i, name in enumerate(LINK_KINDS)}


@dataclass(frozen=True)
class Rates:
    """The link's measured rates in GB/s."""

    zero_copy_gbs: float  # SM-issued reads of mapped host memory, a full grid: how the GPU reads a miss
    copy_gbs: float  # copy-engine host-to-GPU copies: prefill staging, the loan's return


class Link:
    """What the offload moved over the host link, and the emulation of a slower one.

    :param target_gbs: the emulated link's rate (None: the full link, nothing launched).
    :param rates: the measured rates; None measures them now from ``host`` (with a target).
    :param host: a pinned host buffer with a device alias (the host store's first arena: the memory misses read).

    The full link's needs no GPU (``Link(None, torch.device("cpu"))``: the CPU tests' stand-in offloads).
    """

    def __init__(self, kernels: Kernels | None, device: torch.device, host: tuple[torch.Tensor, torch.Tensor] | None = None,
                 target_gbs: float | None = None, rates: Rates | None = None):
        self.kernels, self.device, self.host = kernels, device, host
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.counters = torch.zeros(2 * len(LINK_KINDS), dtype=torch.int64, device=device)
        self.rates = rates
        self.target_gbs: float | None = None
        self._c = LeLink(0.0, 0.0, self.counters.data_ptr())
        self.retarget(target_gbs)

    @property
    def emulating(self) -> bool:
        return self.target_gbs is not None

    def retarget(self, gbs: float | None) -> None:
        """Emulate a link of ``gbs`` GB/s from the next transfer on (None: the full link). A measurement tool's switch
        between runs of one engine; the server sets it once at start.

        :raise ValueError: ``gbs`` is not a positive number, or above the measured rates (it could only be emulated by
            a faster link)."""
        if gbs is None:
            self.target_gbs = None
            return
        if not gbs > 0:
            raise ValueError(f"GLM53_LINK_EMULATE_GBS={gbs!r} is not accepted: expected a rate > 0 GB/s")
        self.measured()
        fastest = min(self.rates.zero_copy_gbs, self.rates.copy_gbs)
        if gbs > ABOVE_MEASURED * fastest:
            raise ValueError(f"GLM53_LINK_EMULATE_GBS={gbs} is not accepted: this machine's link was measured at "
                             f"{self.rates.zero_copy_gbs:.1f} GB/s (zero-copy reads) and {self.rates.copy_gbs:.1f} GB/s "
                             f"(copies); an emulation can only slow it (up to {fastest:.1f})")
        self.target_gbs = float(gbs)
        self._c.zero_copy_ns_per_byte = _added_ns_per_byte(gbs, self.rates.zero_copy_gbs)
        self._c.copy_ns_per_byte = _added_ns_per_byte(gbs, self.rates.copy_gbs)
        log.info("link emulation: %.1f GB/s (measured %.1f GB/s zero-copy, %.1f GB/s copies): +%.4f / +%.4f ns a byte", gbs,
                 self.rates.zero_copy_gbs, self.rates.copy_gbs, self._c.zero_copy_ns_per_byte, self._c.copy_ns_per_byte)

    def measured(self) -> Rates:
        """The full link's rates, measured on the host buffer the first time they are asked for."""
        if self.rates is None:
            if self.host is None:
                raise ValueError("the link's rates are not measured and no host buffer was given to measure them")
            target, self.target_gbs = self.target_gbs, None  # the full link's rate
            self.rates = self.measure(*self.host)
            self.target_gbs = target
        return self.rates

    # ---- transfers, on the current stream (the one that made them)

    def misses(self, state: EcState, row: int, selected: torch.Tensor, weights: torch.Tensor | None, block_bytes: int) -> None:
        """Layer ``row``'s experts among ``selected`` that its kernels read from the host store (``weights``: fp16 router
        weights, where a pick of weight 0 is skipped; None or another dtype: every pick read)."""
        if self.emulating:
            rw = weights if weights is not None and weights.dtype == torch.float16 and weights.is_contiguous() else None
            sel = selected if selected.is_contiguous() else selected.contiguous()
            self.kernels.link_picks(self._c, state, row, sel, rw, block_bytes, KIND["misses"], self.sms)

    def fallback(self, state: EcState, row: int, count: torch.Tensor, block_bytes: int) -> None:
        """The CPU tier's GPU fallback of layer ``row``: its experts with picks in ``count`` read from the host store."""
        if self.emulating:
            self.kernels.link_counts(self._c, state, row, count, block_bytes, KIND["fallback"], self.sms)

    def units(self, count: torch.Tensor, unit_bytes: int, kind: str, blocks: int) -> None:
        """``count`` (int32 [1] on the device) blocks of ``unit_bytes`` read by a grid of ``blocks`` (admissions, prefetch)."""
        if self.emulating:
            self.kernels.link_units(self._c, count, unit_bytes, 0, False, KIND[kind], blocks)

    def tier_io(self, status: torch.Tensor, outcome: torch.Tensor, in_bytes: int, out_bytes: int) -> None:
        """A CPU-tier job's input rows and partial, once collected."""
        if self.emulating:
            self.kernels.link_tier_io(self._c, status, outcome, in_bytes, out_bytes)

    def copied(self, nbytes: int) -> None:
        """A copy-engine copy of ``nbytes`` queued on the current stream."""
        if self.emulating and nbytes > 0:
            self.kernels.link_units(self._c, None, 0, nbytes, True, KIND["copies"], 1)

    def probed(self, nbytes: int, blocks: int) -> None:
        """A read probe of ``nbytes`` by ``blocks`` thread blocks."""
        if self.emulating and nbytes > 0:
            self.kernels.link_units(self._c, None, 0, nbytes, False, KIND["probe"], blocks)

    # ---- rates, measured through this link (the emulated link's, when it emulates)

    def read_rate_gbs(self, src: torch.Tensor, blocks: int, reps: int = 3) -> float:
        """The median rate of ``blocks`` thread blocks reading ``src`` (a device alias of pinned host memory) in
        place, the way a miss is read."""
        out = torch.zeros(1, dtype=torch.int32, device=src.device)
        nbytes = src.numel() * src.element_size()

        def read():
            self.kernels.read_probe(src, out, blocks)
            self.probed(nbytes, blocks)

        return nbytes / cuda_seconds(read, reps) / 1e9

    def copy_rate_gbs(self, host: torch.Tensor, reps: int = 3) -> float:
        """The median rate of the copy engine copying pinned ``host`` memory to the GPU."""
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        nbytes = host.numel() * host.element_size()

        def copy():
            dev.copy_(host, non_blocking=True)
            self.copied(nbytes)

        return nbytes / cuda_seconds(copy, reps) / 1e9

    def measure(self, host: torch.Tensor, alias: torch.Tensor) -> Rates:
        """The link's rates as this link carries them: ``host`` pinned host memory and ``alias`` its device view
        (``PROBE_BYTES`` of them, or all when fewer), read by a full grid and copied."""
        n = min(PROBE_BYTES, host.numel() * host.element_size()) // 16 * 16
        rates = Rates(zero_copy_gbs=self.read_rate_gbs(alias.view(torch.uint8)[:n], self.sms),
                      copy_gbs=self.copy_rate_gbs(host.view(torch.uint8)[:n]))
        torch.cuda.empty_cache()  # the copy's target is not kept reserved against the VRAM budget
        return rates

    # ---- reporting

    def stats(self) -> dict:
        """For ``/stats`` (synchronises with the device)."""
        out: dict = {"emulated_gbs": self.target_gbs}
        if self.rates is not None:
            out["measured"] = {"zero_copy_gbs": round(self.rates.zero_copy_gbs, 2), "copy_gbs": round(self.rates.copy_gbs, 2)}
        if self.emulating:
            values = self.counters.tolist()
            out["held"] = {name: {"bytes": values[2 * i], "seconds": round(values[2 * i + 1] / 1e9, 6)}
                           for i, name in enumerate(LINK_KINDS)}
        return out


def _added_ns_per_byte(target_gbs: float, measured_gbs: float) -> float:
    """What a byte costs more on the target link than on the measured one (never less than nothing)."""
    return max(0.0, 1.0 / target_gbs - 1.0 / measured_gbs)


def cuda_seconds(fn, reps: int, statistic=statistics.median) -> float:
    """``statistic`` (the median; ``min`` for a capacity) of ``fn``'s GPU time over ``reps`` runs after a warm-up,
    timed with CUDA events on the current stream."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return statistic(times)


def start(settings, kernels: Kernels, store, device: torch.device) -> Link:
    """The offload's link: emulated when ``GLM53_LINK_EMULATE_GBS`` is set (measured first, on the host store's
    first arena). :raise ValueError: a target above the measured rates."""
    host = store.probe_region()
    return Link(kernels, device, host, settings.link_emulate_gbs)
