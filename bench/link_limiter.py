"""A slower host link for measurements, without taking a host core: a process of its own keeps the GPU's copy
engines busy with host-to-GPU copies from pinned memory, paced so that what is left for the zero-copy reads of
expert misses is about ``--target-read-gbs`` (25 GB/s: a PCIe 4 x16 card, where the test host's link reads 50).

Only copies (no kernel of this process runs while it limits: a second process's kernels would time-slice the GPU
with the server's and take compute, not link). The pacing thread waits on CUDA events created with blocking sync,
so it sleeps in the driver while its copies run: it costs the host a fraction of one core (reported), and host
DRAM the bytes it copies (reported: what the CPU tier's reads then compete with).

At start it calibrates in place: with the copies running it reads a pinned buffer through the GPU (a kernel
summing it in place, as ``bench/bandwidth.py`` measures ``pcie_zero_copy_read_gbs``) and chooses the number of copy
streams, then the duty cycle, that leave the target (the calibration's kernels run before the limiting starts).

    python3 -m bench.link_limiter --target-read-gbs 25 --ready FILE [--seconds N]

It writes its calibration to ``--ready`` (JSON) when it starts limiting, then runs until SIGTERM / SIGINT (or
``--seconds``); ``--report`` gets the final figures (copy rate over the run, CPU use). ``bench.compare
--link-limit-gbs 25`` runs one beside every arm.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

MIB = 1 << 20
CHUNK_BYTES = 8 * MIB  # one copy; a burst is one per stream
BUFFER_BYTES = 64 * MIB  # the copies cycle through this much host and device memory
PROBE_BYTES = 256 * MIB  # the zero-copy read of the calibration
MAX_STREAMS = 4


class Limiter:
    """Copies ``CHUNK_BYTES`` per stream per burst; with ``duty`` < 1 the thread sleeps between bursts so the copy
    engines are busy that fraction of the time."""

    def __init__(self, streams: int, duty: float):
        import torch

        self.torch = torch
        self.src = torch.empty(BUFFER_BYTES, dtype=torch.uint8, pin_memory=True)
        self.src.fill_(1)
        self.dst = torch.empty(BUFFER_BYTES, dtype=torch.uint8, device="cuda")
        self.streams = [torch.cuda.Stream() for _ in range(MAX_STREAMS)]
        self.set(streams, duty)
        self.copied = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self, streams: int, duty: float) -> None:
        self.n_streams, self.duty = streams, duty

    def _burst(self, offset: int) -> None:
        torch = self.torch
        events = []
        for i, stream in enumerate(self.streams[: self.n_streams]):
            at = (offset + i * CHUNK_BYTES) % BUFFER_BYTES
            with torch.cuda.stream(stream):
                self.dst[at : at + CHUNK_BYTES].copy_(self.src[at : at + CHUNK_BYTES], non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # synchronize() sleeps in the driver instead of spinning
                event.record(stream)
                events.append(event)
        for event in events:
            event.synchronize()
        self.copied += self.n_streams * CHUNK_BYTES

    def _run(self) -> None:
        offset = 0
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self._burst(offset)
            offset = (offset + self.n_streams * CHUNK_BYTES) % BUFFER_BYTES
            if self.duty < 1.0:
                busy = time.perf_counter() - t0
                time.sleep(busy * (1.0 - self.duty) / self.duty)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def zero_copy_read_gbs(reps: int = 7) -> float:
    """The median rate of a GPU kernel reading ``PROBE_BYTES`` of pinned host memory in place."""
    import torch

    from bench.bandwidth import _device_alias

    host = torch.ones(PROBE_BYTES // 4, dtype=torch.int32, pin_memory=True)
    alias, _ = _device_alias(host)
    side = torch.cuda.Stream()
    rates = []
    with torch.cuda.stream(side):
        torch.sum(alias, dtype=torch.int64)  # warm-up
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(side)
            torch.sum(alias, dtype=torch.int64)
            end.record(side)
            end.synchronize()
            rates.append(PROBE_BYTES / (start.elapsed_time(end) / 1000.0) / 1e9)
    return statistics.median(rates)


def calibrate(limiter: Limiter, target_gbs: float, steps: int = 7) -> dict:
    """Streams, then duty, that leave about ``target_gbs`` of zero-copy read rate (the limiter left stopped)."""
    free = zero_copy_read_gbs()
    tried = []

    def leftover(streams: int, duty: float) -> float:
        limiter.set(streams, duty)
        limiter.start()
        time.sleep(0.05)
        try:
            rate = zero_copy_read_gbs()
        finally:
            limiter.stop()
        tried.append({"streams": streams, "duty": round(duty, 3), "zero_copy_read_gbs": round(rate, 2)})
        return rate

    streams, rate = 1, leftover(1, 1.0)
    while rate > target_gbs and streams < MAX_STREAMS:
        streams += 1
        rate = leftover(streams, 1.0)
    duty = 1.0
    if rate < target_gbs:  # too much at full duty: bisect the duty cycle
        lo, hi = 0.0, 1.0
        for _ in range(steps):
            duty = (lo + hi) / 2
            rate = leftover(streams, duty)
            if abs(rate - target_gbs) < 0.5:
                break
            lo, hi = (duty, hi) if rate > target_gbs else (lo, duty)
    return {"target_read_gbs": target_gbs, "free_read_gbs": round(free, 2), "streams": streams, "duty": round(duty, 3),
            "zero_copy_read_gbs": round(rate, 2), "reached": abs(rate - target_gbs) < 0.1 * target_gbs, "tried": tried,
            "chunk_bytes": CHUNK_BYTES}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.link_limiter", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-read-gbs", type=float, default=25.0, help="zero-copy read rate to leave (default 25)")
    ap.add_argument("--ready", type=Path, help="write the calibration (JSON) here once limiting")
    ap.add_argument("--report", type=Path, help="write the final figures (JSON) here at exit")
    ap.add_argument("--seconds", type=float, help="stop after this long (default: at SIGTERM / SIGINT)")
    args = ap.parse_args(argv)
    if not args.target_read_gbs > 0:
        ap.error("--target-read-gbs takes a positive rate")
    limiter = Limiter(1, 1.0)
    calibration = calibrate(limiter, args.target_read_gbs)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    limiter.copied = 0
    cpu0, wall0 = time.process_time(), time.monotonic()
    limiter.start()
    if args.ready:
        args.ready.write_text(json.dumps({**calibration, "pid": os.getpid()}, indent=1) + "\n")
    print(f"link limiter: {calibration['streams']} stream(s) at duty {calibration['duty']}: zero-copy read "
          f"{calibration['zero_copy_read_gbs']} GB/s of {calibration['free_read_gbs']} (target {args.target_read_gbs})", flush=True)
    stopping.wait(args.seconds)
    limiter.stop()
    wall = time.monotonic() - wall0
    report = {**calibration, "seconds": round(wall, 1), "copy_gbs": round(limiter.copied / wall / 1e9, 2),
              "dram_read_gbs": round(limiter.copied / wall / 1e9, 2),  # every copied byte is read from host DRAM
              "cpu_percent_of_one_core": round(100 * (time.process_time() - cpu0) / wall, 2)}
    if args.report:
        args.report.write_text(json.dumps(report, indent=1) + "\n")
    print(f"link limiter: copied {report['copy_gbs']} GB/s for {report['seconds']} s, "
          f"{report['cpu_percent_of_one_core']} % of one core", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
