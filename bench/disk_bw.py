#!/usr/bin/env python3
"""The disk's rate on expert-sized reads, as the RAM tier reads the checkpoint: ``glm53.offload.disk`` with 1..16
reads in flight (one a reader thread), with O_DIRECT and buffered.

A scratch file of ``--experts`` records of 9.44 MB (GLM-5.3-Flash's expert trellises) plus a partial last block is
written once next to ``--file`` and read whole at each depth, every record (by default) at an offset 8 bytes past a block
boundary (a safetensors tensor's offset is rarely aligned) into slots of one page-aligned arena laid out at the expert
stride. With O_DIRECT the reader copies a record's unaligned head and tail through a bounce buffer, and its whole
blocks too where the slot's address is not aligned for memory there: here, when the memory alignment the kernel
reports for the file (``dio_alignment`` in the output: 512 on a virtio disk, 4 on many NVMe drives) does not divide
the skew, every byte is bounced; ``--offset-skew 0``: records on block boundaries, read straight into their slots. The
page cache:

- ``o_direct``: not involved (each pass reads the device);
- ``buffered_cold``: the file's pages are dropped (``fsync``, then ``POSIX_FADV_DONTNEED``) before each pass;
- ``buffered_cached``: a pass reads the file once first, so every later pass is served by the page cache (what a
  checkpoint that fits in free RAM gives, and nothing a RAM-short host gets).

Each figure is the best of ``--reps`` passes (GB/s of delivered bytes) with the median beside it, and the share of
the bytes copied through a bounce buffer. A sample of the records is compared byte for byte with what was written.

``--decode-pieces-kb`` adds decode's pattern (a layer's disk misses submitted as one projection a request, waited for,
then the next layer's) with O_DIRECT, twice, pass for pass: into slots whose addresses are congruent to their records'
file offsets modulo 4096 (so modulo any memory alignment: only each projection's head and tail bounce) and into slots
one byte off that (every byte bounces), which is what aligning the destinations gains on this disk.

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
# decode's destinations: a slot's address minus its record's file offset, modulo ALIGN (0: congruent modulo any memory
# alignment, so only the unaligned heads and tails bounce; 1: aligned for no memory alignment above 1, so all bounces)
DESTINATIONS = {"congruent": 0, "a_byte_off": 1}
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
                arena: np.ndarray, skew: int = SKEW) -> tuple[float, dict]:
    """O_DIRECT GB/s of decode's pattern: ``per_submit`` experts (a layer's disk misses) submitted, waited for, then the
    next, with the engine's reader (``threads`` threads, ``piece_bytes`` pieces); and the reader's counters."""
    with DiskReader([path], threads=threads, piece_bytes=piece_bytes) as reader:
        t0 = time.perf_counter()
        for first in range(0, experts, per_submit):
            reader.read([r for e in range(first, min(first + per_submit, experts)) for r in projection_reads(e, expert_bytes, arena, skew)])
        return experts * expert_bytes / (time.perf_counter() - t0) / 1e9, {"direct": reader.direct(0), **reader.counters()}


def shares(counters: dict) -> dict:
    """The delivered bytes' shares copied through a bounce buffer and read straight into their slots."""
    return {"bounced_share": round(counters["bounced_bytes"] / counters["bytes"], 4),
            "straight_share": round(counters["straight_bytes"] / counters["bytes"], 4)}


def dio_alignment(path: Path) -> dict:
    with DiskReader([path], threads=1) as reader:
        mem, offset = reader.dio_alignment(0)
        return {"direct": reader.direct(0), "mem_align": mem, "offset_align": offset, "files": reader.describe()}


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


def slot_memory(size: int, start: int = 0, huge: bool = False) -> np.ndarray:
    """``size`` bytes of fresh memory beginning ``start`` bytes past a page, touched; ``huge``: advised to transparent
    huge pages, so that its physical pages come in 2 MiB runs (an O_DIRECT read straight into it is then a few large
    DMA segments rather than one a 4 KiB page)."""
    buf = mmap.mmap(-1, start + size)
    if huge:
        buf.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(buf, np.uint8)
    whole[:] = 0
    return whole[start:]


def measure(path: Path, experts: int, expert_bytes: int, depths: list[int], reps: int, skew: int = SKEW,
            piece_bytes: int = PIECE_BYTES, huge: bool = False) -> dict:
    slots = slot_memory(experts * expert_bytes, huge=huge)
    results: dict[str, dict] = {}
    for mode in MODES:
        direct = mode == "o_direct"
        if mode == "buffered_cached":
            one_pass(path, experts, expert_bytes, 4, False, slots, skew, piece_bytes)
        rows = {}
        for depth in depths:
            rates, counters = [], None
            for _ in range(reps):
                if mode == "buffered_cold":
                    drop_cached(path)
                rate, counters = one_pass(path, experts, expert_bytes, depth, direct, slots, skew, piece_bytes)
                rates.append(rate)
            check_sample(path, slots, experts, expert_bytes, skew)
            rows[str(depth)] = {"best_gbs": round(max(rates), 3), "median_gbs": round(statistics.median(rates), 3),
                                "read_direct": counters["direct"], **shares(counters)}
        results[mode] = rows
    return results


def measure_decode(path: Path, experts: int, expert_bytes: int, per_submits: list[int], threads: int, pieces_kb: list[int],
                   reps: int, skew: int = SKEW, huge: bool = False) -> dict:
    """``{destination: {piece KiB: {experts per submit: {best_gbs, median_gbs, bounced_share, straight_share}}}}``:
    decode's pattern at each piece size into slots congruent to their records' file offsets and into slots a byte off
    (DESTINATIONS), the two alternating pass by pass so that both meet the same state of the disk."""
    size = experts * expert_bytes
    arenas = {name: slot_memory(size, (skew + off) % ALIGN, huge) for name, off in DESTINATIONS.items()}
    out: dict[str, dict] = {name: {} for name in DESTINATIONS}
    for kb in pieces_kb:
        for n in per_submits:
            runs: dict[str, list] = {name: [] for name in DESTINATIONS}
            for _ in range(reps):
                for name, slots in arenas.items():
                    runs[name].append(decode_pass(path, experts, expert_bytes, n, threads, kb * 1024, slots, skew))
            for name, slots in arenas.items():
                check_sample(path, slots, experts, expert_bytes, skew)
                rates = [rate for rate, _ in runs[name]]
                row = {"best_gbs": round(max(rates), 3), "median_gbs": round(statistics.median(rates), 3), **shares(runs[name][-1][1])}
                out[name].setdefault(str(kb), {})[str(n)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=Path("disk_bw.scratch"), help="the scratch file (default: here, on this disk)")
    ap.add_argument("--experts", type=int, default=64, help="records in the file (64: 604 MB)")
    ap.add_argument("--expert-bytes", type=int, default=EXPERT_BYTES)
    ap.add_argument("--depths", default="1,2,4,8,16", help="reads in flight to measure at")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--offset-skew", type=int, default=SKEW, help=f"bytes past a block boundary each record starts (default {SKEW}: "
                    "O_DIRECT bounces every byte where the memory alignment does not divide it, else only each record's head and "
                    "tail; 0 with expert bytes a multiple of 4096: all of it goes straight into the slots)")
    ap.add_argument("--piece-kb", type=int, default=PIECE_BYTES // 1024, help="the reader's piece (GLM53_DISK_PIECE_KB)")
    ap.add_argument("--decode-pieces-kb", default="", help="also decode's pattern (a layer's experts read, waited for, the next) "
                    "with the engine's reader at these piece sizes, e.g. 4096,1024,512, into slots congruent to the file "
                    "offsets and into slots a byte off")
    ap.add_argument("--decode-per-submit", default="1,2,4", help="experts a submission in decode's pattern")
    ap.add_argument("--decode-threads", type=int, default=THREADS, help="the reader's threads in decode's pattern (GLM53_DISK_THREADS)")
    ap.add_argument("--huge-pages", action="store_true", help="the slots' memory advised to transparent huge pages "
                    "(MADV_HUGEPAGE): physically contiguous 2 MiB runs, fewer DMA segments a straight read")
    ap.add_argument("--keep", action="store_true", help="leave the scratch file")
    ap.add_argument("--out", help="write the JSON here (default: standard output)")
    ns = ap.parse_args(argv)
    depths = [int(d) for d in ns.depths.split(",")]
    size = write_scratch(ns.file, ns.experts, ns.expert_bytes, skew=ns.offset_skew)
    try:
        alignment = dio_alignment(ns.file)
        results = measure(ns.file, ns.experts, ns.expert_bytes, depths, ns.reps, ns.offset_skew, ns.piece_kb * 1024, ns.huge_pages)
        decode = (measure_decode(ns.file, ns.experts, ns.expert_bytes, [int(n) for n in ns.decode_per_submit.split(",")],
                                 ns.decode_threads, [int(k) for k in ns.decode_pieces_kb.split(",")], ns.reps, ns.offset_skew,
                                 ns.huge_pages)
                  if ns.decode_pieces_kb else None)
    finally:
        if not ns.keep:
            ns.file.unlink()
    emit_json({
        "command": shlex.join(["python3", "bench/disk_bw.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": commit(),
        "machine": {"host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(), "filesystem": filesystem(ns.file.parent)},
        "file_bytes": size, "experts": ns.experts, "expert_bytes": ns.expert_bytes, "offset_skew": ns.offset_skew, "reps": ns.reps,
        "huge_pages": ns.huge_pages,
        "page_cache": {"o_direct": "bypassed", "buffered_cold": "the file's pages dropped (fsync + POSIX_FADV_DONTNEED) before each pass",
                       "buffered_cached": "the file read once first: every pass served from the page cache"},
        "piece_bytes": ns.piece_kb * 1024, "dio_alignment": alignment,
        "gbs_by_reads_in_flight": results,
        **({"decode_pattern": {"threads": ns.decode_threads,
                               "gbs_by_destination_piece_kb_and_experts_per_submit": decode}} if decode else {}),
    }, ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
