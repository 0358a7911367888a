#!/usr/bin/env python3
"""The disk's rate on expert-sized reads, as the RAM tier reads the checkpoint: ``glm53.offload.disk`` with 1..16
reads in flight (one a reader thread), with O_DIRECT and buffered.

A scratch file of ``--experts`` records of 9.44 MB (GLM-5.3-Flash's expert trellises) plus a partial last block is
written once next to ``--file`` and read whole at each depth, every record (by default) at an offset 8 bytes past a block
boundary (a safetensors tensor's offset is rarely aligned) into slots of one arena laid out at the expert stride,
so that O_DIRECT reads go through the bounce buffer as they do for a real checkpoint (``--offset-skew 0``: records on
block boundaries, read straight into their slots, which shows what the bounce costs). The page cache:

- ``o_direct``: not involved (each pass reads the device);
- ``buffered_cold``: the file's pages are dropped (``fsync``, then ``POSIX_FADV_DONTNEED``) before each pass;
- ``buffered_cached``: a pass reads the file once first, so every later pass is served by the page cache (what a
  checkpoint that fits in free RAM gives, and nothing a RAM-short host gets).

Each figure is the best of ``--reps`` passes (GB/s of delivered bytes) with the median beside it. A sample of the
records is compared byte for byte with what was written.

    python3 bench/disk_bw.py [--file PATH] [--experts 64] [--depths 1,2,4,8,16] [--reps 3] [--out result.json]
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.output import emit_json
from glm53.offload.disk import ALIGN, PIECE_BYTES, THREADS, DiskReader, Read

EXPERT_BYTES = 9_437_184  # gate + up + down trellises of one GLM-5.3-Flash expert (3 x 4096 x 2048 x 3 bits / 8)
SKEW = 8  # records start this far past a block boundary (default: a safetensors offset is rarely aligned)
MODES = ("o_direct", "buffered_cold", "buffered_cached")


def write_scratch(path: Path, experts: int, expert_bytes: int, seed: int = 0, skew: int = SKEW) -> int:
    """Random records (and a partial last block) into ``path``, synced; returns the file's size."""
    rng = np.random.default_rng(seed)
    size = skew + experts * expert_bytes + ALIGN // 2
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return size


def drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def one_pass(path: Path, experts: int, expert_bytes: int, depth: int, direct: bool, arena: np.ndarray,
             skew: int = SKEW, piece_bytes: int = PIECE_BYTES) -> tuple[float, dict]:
    reads = [Read(0, skew + e * expert_bytes, expert_bytes, arena[e * expert_bytes:(e + 1) * expert_bytes]) for e in range(experts)]
    with DiskReader([path], threads=depth, direct=direct, piece_bytes=piece_bytes) as reader:
        t0 = time.perf_counter()
        reader.read(reads)
        seconds = time.perf_counter() - t0
        return experts * expert_bytes / seconds / 1e9, {"direct": reader.direct(0), **reader.counters()}


def projection_reads(e: int, expert_bytes: int, arena: np.ndarray, skew: int) -> list[Read]:
    """Record ``e`` as the RAM tier asks for an expert: one request per projection (gate, up, down), each a third."""
    cuts = [0, expert_bytes // 3, 2 * expert_bytes // 3, expert_bytes]
    base = e * expert_bytes
    return [Read(0, skew + base + a, b - a, arena[base + a:base + b]) for a, b in zip(cuts, cuts[1:])]


def decode_pass(path: Path, experts: int, expert_bytes: int, per_submit: int, threads: int, piece_bytes: int,
                arena: np.ndarray, skew: int = SKEW) -> float:
    """O_DIRECT GB/s of decode's pattern: ``per_submit`` experts (a layer's disk misses) submitted, waited for, then the
    next, with the engine's reader (``threads`` threads, ``piece_bytes`` pieces)."""
    with DiskReader([path], threads=threads, piece_bytes=piece_bytes) as reader:
        t0 = time.perf_counter()
        for first in range(0, experts, per_submit):
            reader.read([r for e in range(first, min(first + per_submit, experts)) for r in projection_reads(e, expert_bytes, arena, skew)])
        return experts * expert_bytes / (time.perf_counter() - t0) / 1e9


def check_sample(path: Path, arena: np.ndarray, experts: int, expert_bytes: int, skew: int = SKEW) -> None:
    with open(path, "rb") as f:
        for e in sorted({0, experts // 2, experts - 1}):
            f.seek(skew + e * expert_bytes)
            if f.read(expert_bytes) != arena[e * expert_bytes:(e + 1) * expert_bytes].tobytes():
                raise SystemExit(f"record {e} read back wrong: the reader is broken")


def filesystem(path: Path) -> dict:
    best = ("", "?", "?")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        device, point, fs = line.split()[:3]
        if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best[0]):
            best = (point, fs, device)
    return {"mount": best[0], "type": best[1], "device": best[2]}


def commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def measure(path: Path, experts: int, expert_bytes: int, depths: list[int], reps: int, skew: int = SKEW,
            piece_bytes: int = PIECE_BYTES) -> dict:
    buf = mmap.mmap(-1, experts * expert_bytes)
    arena = np.frombuffer(buf, np.uint8)
    results: dict[str, dict] = {}
    for mode in MODES:
        direct = mode == "o_direct"
        if mode == "buffered_cached":
            one_pass(path, experts, expert_bytes, 4, False, arena, skew, piece_bytes)
        rows = {}
        for depth in depths:
            rates, counters = [], None
            for _ in range(reps):
                if mode == "buffered_cold":
                    drop_cached(path)
                rate, counters = one_pass(path, experts, expert_bytes, depth, direct, arena, skew, piece_bytes)
                rates.append(rate)
            check_sample(path, arena, experts, expert_bytes, skew)
            rows[str(depth)] = {"best_gbs": round(max(rates), 3), "median_gbs": round(statistics.median(rates), 3),
                                "read_direct": counters["direct"], "bounced_share": round(counters["bounced_bytes"] / counters["bytes"], 3)}
        results[mode] = rows
    return results


def measure_decode(path: Path, experts: int, expert_bytes: int, per_submits: list[int], threads: int, pieces_kb: list[int],
                   reps: int, skew: int = SKEW) -> dict:
    """``{piece KiB: {experts per submit: {best_gbs, median_gbs}}}``: decode's pattern at each piece size."""
    arena = np.frombuffer(mmap.mmap(-1, experts * expert_bytes), np.uint8)
    out: dict[str, dict] = {}
    for kb in pieces_kb:
        rows = {}
        for n in per_submits:
            rates = [decode_pass(path, experts, expert_bytes, n, threads, kb * 1024, arena, skew) for _ in range(reps)]
            check_sample(path, arena, experts, expert_bytes, skew)
            rows[str(n)] = {"best_gbs": round(max(rates), 3), "median_gbs": round(statistics.median(rates), 3)}
        out[str(kb)] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=Path("disk_bw.scratch"), help="the scratch file (default: here, on this disk)")
    ap.add_argument("--experts", type=int, default=64, help="records in the file (64: 604 MB)")
    ap.add_argument("--expert-bytes", type=int, default=EXPERT_BYTES)
    ap.add_argument("--depths", default="1,2,4,8,16", help="reads in flight to measure at")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--offset-skew", type=int, default=SKEW, help=f"bytes past a block boundary each record starts (default {SKEW}: "
                    "O_DIRECT reads bounce; 0 with expert bytes a multiple of 4096: they go straight into the slots)")
    ap.add_argument("--piece-kb", type=int, default=PIECE_BYTES // 1024, help="the reader's piece (GLM53_DISK_PIECE_KB)")
    ap.add_argument("--decode-pieces-kb", default="", help="also decode's pattern (a layer's experts read, waited for, the next) "
                    "with the engine's reader at these piece sizes, e.g. 4096,1024,512")
    ap.add_argument("--decode-per-submit", default="1,2,4", help="experts a submission in decode's pattern")
    ap.add_argument("--decode-threads", type=int, default=THREADS, help="the reader's threads in decode's pattern (GLM53_DISK_THREADS)")
    ap.add_argument("--keep", action="store_true", help="leave the scratch file")
    ap.add_argument("--out", help="write the JSON here (default: standard output)")
    ns = ap.parse_args(argv)
    depths = [int(d) for d in ns.depths.split(",")]
    size = write_scratch(ns.file, ns.experts, ns.expert_bytes, skew=ns.offset_skew)
    try:
        results = measure(ns.file, ns.experts, ns.expert_bytes, depths, ns.reps, ns.offset_skew, ns.piece_kb * 1024)
        decode = (measure_decode(ns.file, ns.experts, ns.expert_bytes, [int(n) for n in ns.decode_per_submit.split(",")],
                                 ns.decode_threads, [int(k) for k in ns.decode_pieces_kb.split(",")], ns.reps, ns.offset_skew)
                  if ns.decode_pieces_kb else None)
    finally:
        if not ns.keep:
            ns.file.unlink()
    emit_json({
        "command": shlex.join(["python3", "bench/disk_bw.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": commit(),
        "machine": {"host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(), "filesystem": filesystem(ns.file.parent)},
        "file_bytes": size, "experts": ns.experts, "expert_bytes": ns.expert_bytes, "offset_skew": ns.offset_skew, "reps": ns.reps,
        "page_cache": {"o_direct": "bypassed", "buffered_cold": "the file's pages dropped (fsync + POSIX_FADV_DONTNEED) before each pass",
                       "buffered_cached": "the file read once first: every pass served from the page cache"},
        "piece_bytes": ns.piece_kb * 1024,
        "gbs_by_reads_in_flight": results,
        **({"decode_pattern": {"threads": ns.decode_threads, "gbs_by_piece_kb_and_experts_per_submit": decode}} if decode else {}),
    }, ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
