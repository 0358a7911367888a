"""Busy host for measurements and tests: one spinning process pinned to each of the given CPUs (what other
processes on a shared machine do to the CPU tier), started and stopped as a context manager.

    with CpuHog({2, 3, 4}):
        ...  # the CPU tier's threads now share those CPUs

    python3 -m bench.cpu_hog --cpus 2-5 --seconds 60      # standalone, e.g. beside a server
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable


def _spin(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        pass


class CpuHog:
    """One spinning process per CPU of ``cpus``; ``started_s`` is how long the start took."""

    def __init__(self, cpus: Iterable[int]):
        self.cpus = sorted(set(cpus))

    def __enter__(self) -> CpuHog:
        ctx = multiprocessing.get_context("spawn")  # no copy of the caller's CUDA context or threads
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_spin, args=(cpu, self.stop), daemon=True) for cpu in self.cpus]
        t0 = time.monotonic()
        for p in self.procs:
            p.start()
        time.sleep(0.3)  # spawned and spinning
        self.started_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def parse_cpus(text: str) -> list[int]:
    """A Linux CPU list such as ``2-5,8``."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.cpu_hog", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", default=None, help="CPU list to keep busy (default: every CPU of this process)")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long (default 60)")
    args = ap.parse_args(argv)
    cpus = parse_cpus(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
    with CpuHog(cpus):
        time.sleep(args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
