"""The disk reader on real files (CPU): every expert trellis byte for byte against a plain read, shards' last partial
blocks included, with O_DIRECT where the filesystem takes it and buffered, from concurrent readers; requests cut on
the file's block grid (the kernel's O_DIRECT alignment, checked against statx) with only their unaligned head and tail
bounced where the destination allows; the threads' CPUs; and its faults (an I/O error, a short read, a file truncated
under it, O_DIRECT refused), each with its sentence and nothing served."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import shutil
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from glm53.offload.disk import ALIGN, CPU_SETSIZE, SLOW, DiskReader, DiskReadError, Read
from glm53.offload.host_store import HostStore
from tests.offload.test_host_store import PREFIX, _write_shard

# 18,432 B a projection: each spans five 4 KiB blocks and, with 8 KiB pieces, three pieces at least
SHAPES = {"gate": (16, 12, 48), "up": (16, 12, 48), "down": (12, 16, 48)}
PIECE = 2 * ALIGN


def trellis_checkpoint(root: Path, layers=(1, 2), experts=4, seed=0) -> tuple[Path, dict[str, bytes]]:
    """Two shards of expert trellises only, so that each shard ends with a trellis in a partial block."""
    rng = np.random.default_rng(seed)
    tensors = {f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}_proj.trellis": rng.integers(-32768, 32767, size=shape, dtype=np.int64).astype(np.int16)
               for layer in layers for e in range(experts) for proj, shape in SHAPES.items()}
    names = list(tensors)
    root.mkdir(parents=True, exist_ok=True)
    _write_shard(root / "a.safetensors", {n: tensors[n] for n in names[: len(names) // 2 + 1]})
    _write_shard(root / "b.safetensors", {n: tensors[n] for n in names[len(names) // 2 + 1:]})
    return root, {n: t.tobytes() for n, t in tensors.items()}


def read_every_block(store: HostStore, reader: DiskReader, arena: np.ndarray) -> None:
    """Every expert block of the store read into ``arena`` (laid out as the host store's arenas, one after another)."""
    files = {f: i for i, f in enumerate(store.shard_files())}
    b = store.layout.block_bytes
    reads = [Read(files[f], at, n, arena[(row * store.num_experts + e) * b + off:][:n])
             for row in range(store.num_layers) for e in range(store.num_experts) for f, at, n, off in store.block_sources(row, e)]
    reader.read(reads)


def assert_blocks(store: HostStore, arena: np.ndarray, tensors: dict[str, bytes]) -> None:
    b = store.layout.block_bytes
    for row, key in enumerate(store.layer_keys):
        for e in range(store.num_experts):
            for p, proj in enumerate(("gate", "up", "down")):
                want = tensors[f"{key}.experts.{e}.{proj}_proj.trellis"]
                at = (row * store.num_experts + e) * b + store.layout.offsets[p]
                assert arena[at: at + len(want)].tobytes() == want, (key, e, proj)


def kernel_dio_alignment(path: Path) -> tuple[int, int] | None:
    """(memory, offset) alignment of O_DIRECT on ``path`` as statx(2) reports it (STATX_DIOALIGN), or None: the
    reference :meth:`DiskReader.dio_alignment` is checked against, read through libc rather than the reader."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "statx"):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statx: stx_mask at 0, stx_dio_mem_align and _offset_align at 152
    at_fdcwd, statx_dioalign = -100, 0x2000
    if libc.statx(at_fdcwd, os.fsencode(path), 0, statx_dioalign, buf) != 0:
        return None
    mask = int.from_bytes(buf.raw[0:4], "little")
    mem, offset = int.from_bytes(buf.raw[152:156], "little"), int.from_bytes(buf.raw[156:160], "little")
    return (mem, offset) if mask & statx_dioalign and mem and offset else None


def pieces_of(offset: int, length: int, grid: int, piece: int, straight: bool = True) -> list[tuple[int, int]]:
    """The reader's cut of a request (disk_reader.cpp's cut()), written again for the expected counts: where the whole
    blocks can go ``straight`` (O_DIRECT, the destination aligned for memory at the first of them), the unaligned
    head block alone, the whole blocks every ``piece``, the unaligned tail block alone; else every ``piece`` bytes
    from the block the request starts in."""
    begin, end = offset, offset + length
    if not straight:
        first, last = begin // grid * grid, -(-end // grid) * grid
        return [(a, min(a + piece, last)) for a in range(first, last, piece)]
    body0, body1 = -(-begin // grid) * grid, end // grid * grid
    out = [(begin // grid * grid, body0)] if begin % grid else []
    out += [(a, min(a + piece, body1)) for a in range(body0, body1, piece)]
    if end % grid and body1 >= body0:
        out.append((body1, body1 + grid))
    return out


def expected_counters(offset: int, length: int, address: int, size: int, grid: int, mem: int, piece: int,
                      direct: bool) -> dict[str, int]:
    """What one request adds to the counters: a piece inside the request whose destination is aligned for memory is
    read straight, any other bounced (O_DIRECT); a direct piece reads its blocks up to the end of the file."""
    body_at = address + (-offset) % grid  # the destination at the first whole block
    cut = pieces_of(offset, length, grid, piece, straight=direct and body_at % mem == 0)
    if not direct:
        return {"pieces": len(cut), "disk_bytes": length, "straight_bytes": 0, "bounced_bytes": 0}
    straight = sum(p1 - p0 for p0, p1 in cut if offset <= p0 and p1 <= offset + length and (address + p0 - offset) % mem == 0)
    return {"pieces": len(cut), "disk_bytes": sum(min(p1, size) - p0 for p0, p1 in cut), "straight_bytes": straight,
            "bounced_bytes": length - straight}


def fs_type(path: Path) -> str:
    """The filesystem a path is on, from the longest mount point above it."""
    best, kind = "", "?"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, fs = line.split()[:3]
        if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fs
    return kind


def o_direct_opens(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError as e:
        assert e.errno == errno.EINVAL, e
        return False


def scratch_dirs(tmp_path: Path) -> list[Path]:
    """tmp_path and, where the host has one, a tmpfs: the two kinds of filesystem the reader meets."""
    dirs = [tmp_path]
    shm = Path("/dev/shm")
    if fs_type(tmp_path) != "tmpfs" and shm.is_dir() and os.access(shm, os.W_OK):
        dirs.append(shm / f"glm53-test-disk-{os.getpid()}-{tmp_path.name}")
    return dirs


@pytest.fixture
def scratch(tmp_path):
    """scratch_dirs, made, and the one outside tmp_path removed afterwards."""
    dirs = scratch_dirs(tmp_path)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    yield dirs
    for d in dirs[1:]:
        shutil.rmtree(d)


@pytest.fixture
def checkpoints(scratch):
    return [trellis_checkpoint(d / "ckpt") for d in scratch]


def test_the_shards_end_in_a_partial_block_with_a_trellis(checkpoints):
    for ckpt, _ in checkpoints:
        store = HostStore.scan(ckpt)
        for f in store.shard_files():
            size = f.stat().st_size
            assert size % ALIGN != 0
            last = max((at + n for row in range(store.num_layers) for e in range(store.num_experts)
                        for g, at, n, _ in store.block_sources(row, e) if g == f))
            assert last == size  # the shard's last bytes are a trellis's


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_every_expert_byte_for_byte_on_each_filesystem(checkpoints, direct):
    for ckpt, tensors in checkpoints:
        store = HostStore.scan(ckpt)
        arena = np.full(store.arena_bytes, 0xA5, dtype=np.uint8)  # poisoned: a byte not written shows
        with DiskReader(store.shard_files(), threads=3, direct=direct, piece_bytes=PIECE) as reader:
            read_every_block(store, reader, arena)
            c = reader.counters()
            expect_direct = direct and o_direct_opens(store.shard_files()[0])
            assert [reader.direct(i) for i in range(2)] == [expect_direct] * 2, fs_type(ckpt)
        assert_blocks(store, arena, tensors)
        delivered = store.trellis_bytes
        assert c["requests"] == 3 * store.num_layers * store.num_experts and c["failed"] == 0 and c["bytes"] == delivered
        if expect_direct:
            # whole blocks: more read than delivered, each byte either straight into the arena or through a bounce
            assert c["disk_bytes"] > delivered and c["bounced_bytes"] + c["straight_bytes"] == delivered
        else:
            assert c["disk_bytes"] == delivered and c["bounced_bytes"] == c["straight_bytes"] == 0


def test_the_alignment_is_the_kernels_where_it_reports_one_else_align(checkpoints):
    for ckpt, _ in checkpoints:
        shard = HostStore.scan(ckpt).shard_files()[0]
        kernel = kernel_dio_alignment(shard)
        usable = kernel is not None and max(kernel) <= ALIGN
        with DiskReader([shard]) as reader, DiskReader([shard], direct=False) as buffered:
            assert reader.dio_alignment(0) == (kernel if usable else (ALIGN, ALIGN)), (fs_type(ckpt), kernel)
            assert buffered.dio_alignment(0) == (ALIGN, ALIGN)  # not opened with O_DIRECT: statx not asked
            if reader.direct(0):
                mem, offset = reader.dio_alignment(0)
                key = f"{mem}/{offset} B{'' if usable else ', assumed'}"
                assert reader.summary() == {"files": 1, "o_direct": 1, "dio_alignment": {key: 1}}
                assert reader.describe() == f"O_DIRECT, memory/offset alignment {key}"
            assert buffered.summary() == {"files": 1, "o_direct": 0, "dio_alignment": {}} and buffered.describe() == "buffered"
            with pytest.raises(ValueError, match="file 1 is not one of the reader's 1 files"):
                reader.dio_alignment(1)


def test_the_cut_isolates_the_unaligned_head_and_tail():
    g, piece = 512, 4 * 512
    assert pieces_of(3 * g + 8, 10 * g, g, piece) == [(3 * g, 4 * g), (4 * g, 8 * g), (8 * g, 12 * g), (12 * g, 13 * g), (13 * g, 14 * g)]
    assert pieces_of(g + 10, 20, g, piece) == [(g, 2 * g)]  # within one block: one piece
    assert pieces_of(2 * g - 8, 16, g, piece) == [(g, 2 * g), (2 * g, 3 * g)]  # across one boundary: head and tail
    assert pieces_of(2 * g, 3 * g, g, piece) == [(2 * g, 5 * g)]  # aligned both ends: whole blocks only
    assert pieces_of(2 * g, 100, g, piece) == [(2 * g, 3 * g)]  # aligned start, shorter than a block: the tail only
    # nothing can go straight: every piece bytes from the first block, no head or tail of their own
    assert pieces_of(3 * g + 8, 10 * g, g, piece, straight=False) == [(3 * g, 7 * g), (7 * g, 11 * g), (11 * g, 14 * g)]
    assert pieces_of(g + 10, 20, g, piece, straight=False) == [(g, 2 * g)]


# (offset, length) on the file's grid g of a file of `size` bytes: unaligned head and tail, within one block, across
# one boundary, aligned, aligned start and short, in the last partial block, up to the end of the file, the whole file
CASES = {"head_and_tail": lambda g, size: (2 * g + 8, 9 * g + 100),
         "within_a_block": lambda g, size: (g + 10, 20),
         "across_a_boundary": lambda g, size: (2 * g - 8, 16),
         "aligned": lambda g, size: (2 * g, 8 * g),
         "aligned_start_short": lambda g, size: (3 * g, 100),
         "last_partial_block": lambda g, size: (size // g * g + 4, size % g - 4),
         "to_the_end": lambda g, size: (5 * g + 3, size - 5 * g - 3),
         "whole_file": lambda g, size: (0, size)}


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_every_byte_of_every_cut_into_destinations_aligned_or_not(scratch, direct):
    """Each case into a destination congruent to the file offset modulo the memory alignment (the whole blocks go
    straight, only the head and tail bounce) and into one a byte off it (every byte bounces), inside a poisoned margin
    that must stay untouched; the counters exactly as the cut predicts. On each filesystem: here ext4's 512-byte grid
    (the kernel's) and tmpfs's 4 KiB (align's: tmpfs reports none)."""
    for d in scratch:
        check_every_cut(d / "f.bin", direct)


def check_every_cut(path: Path, direct: bool) -> None:
    size = 40 * ALIGN + 300  # a partial last block on any grid up to align
    data = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    arena = np.frombuffer(mmap.mmap(-1, size + 4 * ALIGN), np.uint8)  # page-aligned
    with DiskReader([path], threads=3, direct=direct, piece_bytes=2 * ALIGN) as reader:
        mem, grid = reader.dio_alignment(0)
        if direct and not reader.direct(0):
            warnings.warn(f"{fs_type(path)} at {path} refused O_DIRECT: only the buffered path was checked")
        for name, case in CASES.items():
            offset, length = case(grid, size)
            for shift in (0, 1):  # congruent to the file offset modulo any alignment up to align; a byte off it
                arena[:] = 0xA5
                at = ALIGN + offset % ALIGN + shift
                dest = arena[at: at + length]
                before = reader.counters()
                reader.read([Read(0, offset, length, dest)])
                after = reader.counters()
                assert dest.tobytes() == data[offset: offset + length].tobytes(), (name, shift)
                assert (arena[:at] == 0xA5).all() and (arena[at + length:] == 0xA5).all(), (name, shift)
                got = {k: after[k] - before[k] for k in ("pieces", "disk_bytes", "straight_bytes", "bounced_bytes")}
                assert got == expected_counters(offset, length, dest.ctypes.data, size, grid, mem, 2 * ALIGN, reader.direct(0)), \
                    (name, shift, grid, mem)
                if not reader.direct(0):
                    continue
                if shift == 0:  # only the head's and the tail's bytes copied, a block each at most
                    head, tail = (-offset) % grid, (offset + length) % grid
                    assert got["bounced_bytes"] == (length if offset // grid == (offset + length - 1) // grid else head + tail), name
                elif mem > 1:
                    assert got["straight_bytes"] == 0 and got["bounced_bytes"] == length, name


def test_a_destination_congruent_to_the_file_is_read_straight_but_its_head_and_tail(tmp_path):
    """Decode's case: a safetensors offset 8 bytes past a block into a slot as far past an aligned address: the whole
    blocks go straight into the slot, only the two partial ones through the bounce buffer."""
    path = tmp_path / "f.bin"
    data = np.random.default_rng(1).integers(0, 256, 10 * ALIGN + 123, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    offset, length = ALIGN + 8, 7 * ALIGN
    buf = mmap.mmap(-1, 10 * ALIGN)
    dest = np.frombuffer(buf, np.uint8)[8: 8 + length]  # the same offset within a block as in the file
    with DiskReader([path], threads=2, piece_bytes=ALIGN) as reader:
        grid = reader.dio_alignment(0)[1]
        reader.read([Read(0, offset, length, dest)])
        c, read_direct = reader.counters(), reader.direct(0)
    assert dest.tobytes() == data[offset: offset + length].tobytes()
    if read_direct:  # the head (grid - 8 bytes) and the tail (8 bytes) bounce
        assert c["bounced_bytes"] == grid and c["straight_bytes"] == length - grid and c["disk_bytes"] == length + grid
    else:
        warnings.warn(f"{fs_type(tmp_path)} at {tmp_path} refused O_DIRECT: only the buffered path was checked")
        assert c["bounced_bytes"] == c["straight_bytes"] == 0


def test_a_straight_read_refused_sends_the_file_to_buffered_reads(tmp_path):
    """An alignment the kernel reported wrong: the straight read is refused (EINVAL) and the file is read buffered
    from then on, every byte right."""
    path = tmp_path / "f.bin"
    data = np.random.default_rng(2).integers(0, 256, 16 * ALIGN, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    offset, length = 2 * ALIGN + 8, 12 * ALIGN
    dest = np.frombuffer(mmap.mmap(-1, 16 * ALIGN), np.uint8)[8: 8 + length]
    with DiskReader([path], threads=1, piece_bytes=ALIGN) as reader:
        if not reader.direct(0):
            pytest.fail(f"{fs_type(tmp_path)} at {tmp_path} refuses O_DIRECT: this test needs a filesystem with it")
        reader.inject(0, 6 * ALIGN, errno.EINVAL)  # inside the request: a whole-block piece, read straight
        reader.read([Read(0, offset, length, dest)])
        c = reader.counters()
        assert not reader.direct(0) and c["fallbacks"] == 1 and c["failed"] == 0 and c["straight_bytes"] > 0
    assert dest.tobytes() == data[offset: offset + length].tobytes()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_one_request_is_read_as_its_pieces_by_every_thread(tmp_path, direct):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(3).integers(0, 256, 40 * ALIGN + 321, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    offset, length = 3 * ALIGN + 8, 30 * ALIGN + 100  # 8 bytes past a block, as a safetensors tensor's offset
    dest = np.full(length, 0xA5, np.uint8)
    with DiskReader([path], threads=4, direct=direct, piece_bytes=2 * ALIGN) as reader:
        mem, grid = reader.dio_alignment(0)
        reader.read([Read(0, offset, length, dest)])
        c, read_direct = reader.counters(), reader.direct(0)
    assert dest.tobytes() == data[offset: offset + length].tobytes()
    # the head block alone, the whole blocks from its end to the tail's cut every 2 x 4 KiB, the tail block alone: 17
    # preads on a 512-byte grid and on a 4 KiB one, one request; where nothing can go straight (buffered, or a
    # destination not aligned there), every 2 x 4 KiB from the first block: 16
    straight = read_direct and (dest.ctypes.data + (-offset) % grid) % mem == 0
    cut = pieces_of(offset, length, grid, 2 * ALIGN, straight)
    assert c["pieces"] == len(cut) == (17 if straight else 16) and c["requests"] == 1 and c["bytes"] == length
    assert c["disk_bytes"] == (cut[-1][1] - cut[0][0] if read_direct else length)


def test_a_submission_may_cut_its_reads_finer_than_the_reader(tmp_path):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(8).integers(0, 256, 20 * ALIGN, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with DiskReader([path], threads=2, piece_bytes=4 * ALIGN) as reader:
        dest = np.zeros(16 * ALIGN, np.uint8)
        reader.submit([Read(0, 2 * ALIGN, 16 * ALIGN, dest)], piece_bytes=ALIGN).wait()
        assert reader.counters()["pieces"] == 16 and dest.tobytes() == data[2 * ALIGN: 18 * ALIGN].tobytes()
        for bad in (ALIGN + 1, 8 * ALIGN):  # not a multiple of the alignment; above the reader's (its bounce buffer)
            with pytest.raises(ValueError, match=f"piece_bytes is {bad}: it must be 0, or a multiple of 4096 up to the reader's 16384"):
                reader.submit([Read(0, 0, ALIGN, np.zeros(ALIGN, np.uint8))], piece_bytes=bad)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_request_whose_pieces_fail_reports_its_lowest_failure_whichever_thread_met_it_first(tmp_path, direct):
    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(4).integers(0, 256, 40 * ALIGN, dtype=np.uint8).tobytes())
    with DiskReader([path], threads=4, direct=direct, piece_bytes=2 * ALIGN) as reader:
        reader.inject(0, 30 * ALIGN + 7, errno.EIO, times=2)  # retried once: fails
        reader.inject(0, 10 * ALIGN + 7, errno.EIO, times=2)
        other = np.zeros(ALIGN, np.uint8)
        batch = reader.submit([Read(0, ALIGN, 36 * ALIGN, np.zeros(36 * ALIGN, np.uint8)), Read(0, 0, ALIGN, other)])
        batch.wait()
        assert batch.done() == [False, True]
        (err,) = batch.errors()
        assert err.errno == errno.EIO and err.failed_at == 9 * ALIGN and err.request == 0  # its piece [9, 11) blocks
        assert reader.counters()["failed"] == 1


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_cancelled_read_drops_its_queued_pieces_and_the_others_are_read_whole(tmp_path, direct):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(5).integers(0, 256, 64 * ALIGN, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with DiskReader([path], threads=1, direct=direct, piece_bytes=ALIGN) as reader:
        reader.inject(0, 0, SLOW)  # the one thread's first piece waits: the cancel lands while the rest are queued
        dests = [np.zeros(ALIGN, np.uint8), np.full(30 * ALIGN, 0xA5, np.uint8), np.full(30 * ALIGN, 0xA5, np.uint8)]
        batch = reader.submit([Read(0, 0, ALIGN, dests[0]), Read(0, ALIGN, 30 * ALIGN, dests[1]),
                               Read(0, 32 * ALIGN, 30 * ALIGN, dests[2])])
        batch.cancel([1])
        batch.wait()
        assert batch.done() == [True, False, True]
        assert dests[0].tobytes() == data[:ALIGN].tobytes() and dests[2].tobytes() == data[32 * ALIGN: 62 * ALIGN].tobytes()
        assert (dests[1] == 0xA5).all()  # none of its 30 pieces was read
        (cancelled,) = batch.errors()
        assert cancelled.errno == errno.ECANCELED and cancelled.request == 1
        assert reader.counters()["pieces"] == 1 + 30 and reader.counters()["failed"] == 1
        later = np.zeros(ALIGN, np.uint8)
        reader.read([Read(0, 5 * ALIGN, ALIGN, later)])  # the reader goes on
        assert later.tobytes() == data[5 * ALIGN: 6 * ALIGN].tobytes()


def test_cancelling_a_finished_read_leaves_it_done(tmp_path):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(6).integers(0, 256, 8 * ALIGN, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with DiskReader([path], threads=2, piece_bytes=ALIGN) as reader:
        dest = np.zeros(4 * ALIGN, np.uint8)
        batch = reader.submit([Read(0, ALIGN, 4 * ALIGN, dest)])
        batch.wait()
        batch.cancel()
        batch.wait()
        assert batch.done() == [True] and batch.errors() == [] and dest.tobytes() == data[ALIGN: 5 * ALIGN].tobytes()


def test_concurrent_submitters_and_readers_get_their_own_bytes(tmp_path):
    ckpt, tensors = trellis_checkpoint(tmp_path / "ckpt", layers=(1, 2, 3), experts=6, seed=2)
    store = HostStore.scan(ckpt)
    arenas = [np.zeros(store.arena_bytes, np.uint8) for _ in range(4)]
    shared = DiskReader(store.shard_files(), threads=4, piece_bytes=PIECE)
    own = [DiskReader(store.shard_files(), threads=2, direct=False), DiskReader(store.shard_files(), threads=2)]
    errors = []

    def run(reader, arena):
        try:
            read_every_block(store, reader, arena)
        except Exception as e:  # noqa: BLE001 (reported below, with the thread's failure)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r, a)) for r, a in zip([shared, shared, *own], arenas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in [shared, *own]:
        r.close()
    assert errors == []
    for arena in arenas:
        assert_blocks(store, arena, tensors)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_an_io_error_is_retried_once_then_fails_that_read_alone_naming_file_and_offset(tmp_path, direct):
    ckpt, tensors = trellis_checkpoint(tmp_path / "ckpt")
    store = HostStore.scan(ckpt)
    f, at, n, _ = store.block_sources(1, 2)[1]
    file = store.shard_files().index(f)
    with DiskReader(store.shard_files(), threads=2, direct=direct, piece_bytes=PIECE) as reader:
        reader.inject(file, at + 5000, errno.EIO, times=1)  # once: the retry reads it
        once = np.zeros(n, np.uint8)
        reader.read([Read(file, at, n, once)])
        assert once.tobytes() == tensors[f"{store.layer_keys[1]}.experts.2.up_proj.trellis"]
        assert reader.counters()["retries"] == 1

        reader.inject(file, at + 5000, errno.EIO, times=2)
        other_f, other_at, other_n, _ = store.block_sources(0, 0)[0]
        dests = [np.zeros(n, np.uint8), np.zeros(other_n, np.uint8)]
        batch = reader.submit([Read(file, at, n, dests[0]), Read(store.shard_files().index(other_f), other_at, other_n, dests[1])])
        batch.wait()
        assert batch.done() == [False, True]
        assert dests[1].tobytes() == tensors[f"{store.layer_keys[0]}.experts.0.gate_proj.trellis"]
        (err,) = batch.errors()
        assert isinstance(err, DiskReadError) and err.errno == errno.EIO and err.request == 0 and not err.truncated
        # the piece that covers the fault: where the failed pread began
        mem, grid = reader.dio_alignment(file)
        straight = reader.direct(file) and (dests[0].ctypes.data + (-at) % grid) % mem == 0
        piece = max(p0 for p0, _ in pieces_of(at, n, grid, PIECE, straight) if p0 <= at + 5000)
        assert err.failed_at == (piece if direct else max(piece, at))  # buffered reads start at the request's first byte
        assert str(err).startswith(f"{f}: reading {n} bytes at byte {at} failed at byte {err.failed_at} with EIO")
        assert "dmesg" in str(err) and "also when retried" in str(err)
        with pytest.raises(DiskReadError, match="with EIO"):
            reader.inject(file, at + 5000, errno.EIO, times=2)
            reader.read([Read(file, at, n, dests[0])])
        assert reader.counters()["failed"] == 2


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_short_read_is_continued_to_the_last_byte(tmp_path, direct):
    ckpt, tensors = trellis_checkpoint(tmp_path / "ckpt")
    store = HostStore.scan(ckpt)
    f, at, n, _ = store.block_sources(0, 3)[2]
    file = store.shard_files().index(f)
    with DiskReader(store.shard_files(), threads=1, direct=direct, piece_bytes=4 * ALIGN) as reader:
        reader.inject(file, at + n // 2, None, times=3)  # a piece of whole blocks: the tail's one block has no half
        dest = np.zeros(n, np.uint8)
        reader.read([Read(file, at, n, dest)])
        assert reader.counters()["short_reads"] >= 1 and reader.counters()["retries"] == 0
    assert dest.tobytes() == tensors[f"{store.layer_keys[0]}.experts.3.down_proj.trellis"]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_file_truncated_under_the_reader_fails_with_where_it_ends(tmp_path, direct):
    ckpt, _ = trellis_checkpoint(tmp_path / "ckpt")
    store = HostStore.scan(ckpt)
    shard = store.shard_files()[1]
    f, at, n, _ = store.block_sources(1, 3)[2]  # the last trellis of the last shard
    assert f == shard and at + n == shard.stat().st_size
    with DiskReader(store.shard_files(), threads=2, direct=direct) as reader:
        os.truncate(shard, at + n - 1000)
        dest = np.zeros(n, np.uint8)
        with pytest.raises(DiskReadError) as info:
            reader.read([Read(1, at, n, dest)])
    err = info.value
    assert err.truncated and err.failed_at == at + n - 1000 and err.errno == errno.EIO
    assert str(err) == (f"{shard}: reading {n} bytes at byte {at} failed: the file ends at byte {at + n - 1000} (it is "
                        f"{at + n - 1000} bytes now), before the read's last byte {at + n - 1}: the file is truncated or was "
                        "changed while being served; fetch the checkpoint again and restart")


def test_o_direct_refused_falls_back_to_buffered_reads_with_one_warning(tmp_path, caplog):
    ckpt, tensors = trellis_checkpoint(tmp_path / "ckpt")
    store = HostStore.scan(ckpt)
    arena = np.zeros(store.arena_bytes, np.uint8)
    with DiskReader(store.shard_files(), threads=2, piece_bytes=PIECE) as reader:
        assert reader.direct(0) and reader.direct(1)
        f, at, _, _ = store.block_sources(0, 1)[0]
        reader.inject(store.shard_files().index(f), at, errno.EINVAL)  # what a filesystem without O_DIRECT answers
        with caplog.at_level(logging.WARNING, logger="glm53.offload.disk"):
            read_every_block(store, reader, arena)
            read_every_block(store, reader, arena)
        assert [reader.direct(i) for i in range(2)] == [False, True]
        assert reader.counters()["fallbacks"] == 1 and reader.counters()["failed"] == 0
    assert_blocks(store, arena, tensors)
    (record,) = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    # the read that met the fault names its own first byte: the injected one, or an earlier one of a read covering it
    # (which of the threads' reads gets there first varies)
    found = re.match(rf"{re.escape(str(f))} refused O_DIRECT \(EINVAL at a read at byte (\d+)\): reading buffered", record.getMessage())
    assert found and int(found.group(1)) <= at


def test_set_cpus_moves_every_reader_thread_and_back(tmp_path):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(7).integers(0, 256, 8 * ALIGN, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    allowed = set(os.sched_getaffinity(0))  # this thread's CPUs, which the reader's threads start on
    last = max(allowed)
    with DiskReader([path], threads=3, piece_bytes=ALIGN) as reader:
        assert reader.cpus() == [allowed] * 3
        reader.set_cpus([last])
        assert reader.cpus() == [{last}] * 3
        dest = np.zeros(6 * ALIGN, np.uint8)
        reader.read([Read(0, ALIGN + 8, 6 * ALIGN, dest)])  # pinned threads still read
        assert dest.tobytes() == data[ALIGN + 8: 7 * ALIGN + 8].tobytes()
        reader.set_cpus([])
        assert reader.cpus() == [allowed] * 3
        reader.set_cpus([last])
        reader.set_cpus(None)
        assert reader.cpus() == [allowed] * 3
        reader.set_cpus([last, CPU_SETSIZE - 1])  # a CPU the process may not use is left out (no machine here has 1,024)
        assert reader.cpus() == [{last}] * 3
        with pytest.raises(ValueError, match="CPU -1 is out of range"):
            reader.set_cpus([-1])
        with pytest.raises(ValueError, match="none of those CPUs is one this process may use"):
            reader.set_cpus([CPU_SETSIZE - 1])
        assert reader.cpus() == [{last}] * 3  # a refused move leaves them where they were


def test_bad_arguments_are_refused_before_anything_is_read(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(OSError, match="nope.bin: cannot open: No such file"):
        DiskReader([tmp_path / "nope.bin"])
    with pytest.raises(ValueError, match="align 3000 a power of two"):
        DiskReader([path], align=3000)
    reader = DiskReader([path], threads=1)
    with pytest.raises(ValueError, match="file 1 is not one of the reader's 1 files"):
        reader.submit([Read(1, 0, 16, np.zeros(16, np.uint8))])
    with pytest.raises(ValueError, match="a writable contiguous buffer of 16 bytes, not 32 bytes"):
        reader.submit([Read(0, 0, 16, np.zeros(32, np.uint8))])
    with pytest.raises(ValueError, match="not 16 bytes, read-only"):
        reader.submit([Read(0, 0, 16, bytes(16))])
    with pytest.raises(ValueError, match="length 0 >= 1"):
        reader.submit([Read(0, 0, 0, np.zeros(0, np.uint8))])
    assert reader.counters()["requests"] == 0
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.submit([Read(0, 0, 16, np.zeros(16, np.uint8))])
