"""A slower host link for measurements, without taking a host core: what the zero-copy reads of expert misses are
left when something else shares the link, about ``target_read_gbs`` (25 GB/s: a PCIe 4 x16 card, where the test
host's link reads about 50).

Two ways, both paced by a thread that sleeps on CUDA events created with blocking sync (it costs the host a
fraction of one core, reported):

- ``SmReader`` (what ``bench.compare --link-limit-gbs`` uses, in every arm's process and in the bandwidth
  measurement's): short kernels of a few blocks reading pinned host memory on a low-priority stream of their own,
  launched back to back by a native thread (``native/ec/link_load.cuh``) for ``duty`` of the time. They compete
  with the misses the way a slower link would: the same SM-issued reads over the same link.
- ``CopyLimiter`` (``--mode copy``, a process of its own): host-to-GPU copies on the copy engines. No kernel, but on
  the test host the copy engines alone leave SM reads about three quarters of the link (measured 37.5 of 48.7
  GB/s with four copy streams at full duty), so it cannot emulate a PCIe 4 card there.

Calibration, in place, before the limiting starts: with the limiter running, 64 thread blocks read a pinned buffer
in place (the expert cache's read probe: a decode step's misses are read by a grid of about that size, and a grid
that filled the GPU would keep the limiter's kernels waiting), and the limiter's level (blocks or copy streams),
then its duty cycle, are chosen so that the read rate left is the target. Every host byte the limiter reads also costs host
DRAM bandwidth (reported: what the CPU tier's reads compete with).

    python3 -m bench.link_limiter --target-read-gbs 25 [--mode sm|copy] [--seconds 10] [--report FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

MIB = 1 << 20
PROBE_BYTES = 256 * MIB  # the zero-copy read of the calibration
READ_BYTES = 256 * MIB  # pinned host memory the SM reader cycles through
READ_CHUNK = 8 * MIB  # one of its kernels
SM_BLOCKS = (4, 8, 16, 32, 64, 128)  # its levels
COPY_CHUNK = 8 * MIB  # one copy of the copy limiter, per stream and burst
COPY_BUFFER = 64 * MIB
MAX_STREAMS = 4


PROBE_BLOCKS = 64  # the probe's grid: about what a decode step's expert kernels read misses with, leaving SMs free


def zero_copy_read_gbs(reps: int = 7, blocks: int = PROBE_BLOCKS) -> float:
    """The median rate of ``blocks`` thread blocks reading ``PROBE_BYTES`` of pinned host memory in place (the
    expert cache's read probe). A grid that fills the GPU would keep a concurrent reader's kernels waiting and
    measure the link alone."""
    import torch

    from glm53.offload.ec_native import Kernels

    kernels = Kernels()
    host = torch.ones(PROBE_BYTES // 4, dtype=torch.int32, pin_memory=True)
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream

    def read():  # pinned memory has the same address on the device (UVA)
        kernels._check(kernels._lib.ec_read_probe(host.data_ptr(), PROBE_BYTES, sink.data_ptr(), blocks, stream), "ec_read_probe")

    read()  # warm-up
    rates = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        read()
        end.record()
        end.synchronize()
        rates.append(PROBE_BYTES / (start.elapsed_time(end) / 1000.0) / 1e9)
    return statistics.median(rates)


class SmReader:
    """Paced SM reads of ``READ_BYTES`` of pinned host memory (``native/ec/link_load.cuh``), in this process."""

    levels = SM_BLOCKS
    level_name = "blocks"

    def __init__(self):
        import torch

        from glm53.native import cuda

        self.host = torch.ones(READ_BYTES // 4, dtype=torch.int32, pin_memory=True)
        lib, _ = cuda.library()
        lib.ec_link_load_start.restype = ctypes.c_void_p
        lib.ec_link_load_start.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_int]
        lib.ec_link_load_stop.restype = ctypes.c_int64
        lib.ec_link_load_stop.argtypes = [ctypes.c_void_p]
        self._lib, self._device = lib, torch.cuda.current_device()
        self._handle = None
        self.level, self.duty, self.read = SM_BLOCKS[0], 1.0, 0

    def set(self, level: int, duty: float) -> None:
        self.level, self.duty = level, duty

    def start(self) -> None:
        # pinned memory has the same address on the device (UVA)
        self._handle = self._lib.ec_link_load_start(self.host.data_ptr(), READ_BYTES, self.level, READ_CHUNK, self.duty, self._device)
        if not self._handle:
            raise RuntimeError("the SM reader did not start (ec_link_load_start)")

    def stop(self) -> None:
        if self._handle:
            self.read += self._lib.ec_link_load_stop(self._handle)
            self._handle = None


class CopyLimiter:
    """Host-to-GPU copies of ``COPY_CHUNK`` per stream per burst on up to ``MAX_STREAMS`` streams (the level), with
    the thread asleep between bursts for ``1 - duty`` of the time."""

    levels = tuple(range(1, MAX_STREAMS + 1))
    level_name = "streams"

    def __init__(self):
        import torch

        self.torch = torch
        self.src = torch.ones(COPY_BUFFER, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(COPY_BUFFER, dtype=torch.uint8, device="cuda")
        self.streams = [torch.cuda.Stream() for _ in range(MAX_STREAMS)]
        self.level, self.duty, self.read = 1, 1.0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self, level: int, duty: float) -> None:
        self.level, self.duty = level, duty

    def _burst(self, offset: int) -> None:
        torch = self.torch
        events = []
        for i, stream in enumerate(self.streams[: self.level]):
            at = (offset + i * COPY_CHUNK) % COPY_BUFFER
            with torch.cuda.stream(stream):
                self.dst[at : at + COPY_CHUNK].copy_(self.src[at : at + COPY_CHUNK], non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # synchronize() sleeps in the driver instead of spinning
                event.record(stream)
                events.append(event)
        for event in events:
            event.synchronize()
        self.read += self.level * COPY_CHUNK

    def _run(self) -> None:
        offset = 0
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self._burst(offset)
            offset = (offset + self.level * COPY_CHUNK) % COPY_BUFFER
            if self.duty < 1.0:
                time.sleep((time.perf_counter() - t0) * (1.0 - self.duty) / self.duty)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def calibrate(limiter, target_gbs: float, steps: int = 7) -> dict:
    """The level, then the duty, that leave about ``target_gbs`` of zero-copy read rate (the limiter left stopped)."""
    free = zero_copy_read_gbs()
    tried = []

    def leftover(level: int, duty: float) -> float:
        limiter.set(level, duty)
        limiter.start()
        time.sleep(0.05)
        try:
            rate = zero_copy_read_gbs()
        finally:
            limiter.stop()
        tried.append({limiter.level_name: level, "duty": round(duty, 3), "zero_copy_read_gbs": round(rate, 2)})
        return rate

    levels = list(limiter.levels)
    level = levels.pop(0)
    rate = leftover(level, 1.0)
    while rate > target_gbs and levels:
        level = levels.pop(0)
        rate = leftover(level, 1.0)
    duty = 1.0
    if rate < target_gbs:  # too much at full duty: bisect the duty cycle
        lo, hi = 0.0, 1.0
        for _ in range(steps):
            duty = (lo + hi) / 2
            rate = leftover(level, duty)
            if abs(rate - target_gbs) < 0.5:
                break
            lo, hi = (duty, hi) if rate > target_gbs else (lo, duty)
    limiter.set(level, duty)
    return {"mode": type(limiter).__name__, "target_read_gbs": target_gbs, "free_read_gbs": round(free, 2),
            limiter.level_name: level, "duty": round(duty, 3), "zero_copy_read_gbs": round(rate, 2),
            "reached": abs(rate - target_gbs) < 0.1 * target_gbs, "tried": tried}


class Limited:
    """``with Limited(25) as info:`` the calibrated SM reader runs in this process for the block; ``info`` gets the
    calibration, then the figures of the run (its read rate, which is also what it cost host DRAM, and its CPU use)."""

    def __init__(self, target_gbs: float, limiter=None):
        self.target_gbs, self.limiter = target_gbs, limiter
        self.info: dict = {}

    def __enter__(self) -> dict:
        self.limiter = self.limiter or SmReader()
        self.info.update(calibrate(self.limiter, self.target_gbs))
        self.limiter.read = 0
        self._cpu0, self._wall0 = time.process_time(), time.monotonic()
        self.limiter.start()
        return self.info

    def __exit__(self, *exc) -> None:
        cpu = time.process_time() - self._cpu0  # the whole process's: an upper bound on the limiter's own
        self.limiter.stop()
        wall = time.monotonic() - self._wall0
        self.info.update(seconds=round(wall, 1), read_gbs=round(self.limiter.read / wall / 1e9, 2),
                         process_cpu_percent_of_one_core=round(100 * cpu / wall, 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.link_limiter", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-read-gbs", type=float, default=25.0, help="zero-copy read rate to leave (default 25)")
    ap.add_argument("--mode", choices=("sm", "copy"), default="sm", help="SM reads (default) or copy-engine copies")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long to limit (default 10; SIGTERM stops it sooner)")
    ap.add_argument("--report", type=Path, help="write the figures (JSON) here (default: print them)")
    args = ap.parse_args(argv)
    if not args.target_read_gbs > 0:
        ap.error("--target-read-gbs takes a positive rate")
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    with Limited(args.target_read_gbs, SmReader() if args.mode == "sm" else CopyLimiter()) as info:
        print(f"link limiter: {info}", flush=True)
        stopping.wait(args.seconds)
    text = json.dumps(info, indent=1) + "\n"
    if args.report:
        args.report.write_text(text)
    print(text, end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
