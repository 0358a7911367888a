"""The disk reader's binding (``native/disk/disk_reader.h``): the checkpoint's own files read into caller memory
(the RAM tier's pinned slots) with ``O_DIRECT``, by a pool of threads with several requests in flight.

``O_DIRECT`` skips the page cache, so an expert read from disk is in host RAM once (its slot), not twice. A
filesystem that refuses it (``EINVAL``: tmpfs before Linux 6.6, some network and FUSE filesystems) is read buffered,
with one warning; ``direct=False`` asks for buffered reads outright. Every request's outcome is its own: a failed
read (an I/O error, retried once; a file that ends early) fails that request, with a sentence naming the file and
offset, and its destination is not to be used.

``O_DIRECT`` wants file offsets and lengths aligned to the device's block (512 or 4096 bytes) and memory addresses
aligned too, often more loosely (4 bytes on many NVMe drives under ext4 or xfs, 512 on a virtio disk): the reader asks
the kernel per file (``statx``, Linux 6.1) and assumes ``align`` for both where it does not say
(:meth:`DiskReader.dio_alignment`). Where the destination's address at the read's first whole block is aligned for
memory (a destination congruent to the file offset modulo the memory alignment: where that is 4, any 4-byte-aligned one
for an offset that is a multiple of 4), the read is cut on its file's block grid: its unaligned head and tail, a block
each at most, go through a thread's aligned bounce buffer and are copied out, and the whole blocks between are read
straight into the destination. Elsewhere every byte is bounced, and the read is cut every piece from its first block
(no head and tail of their own: two preads fewer). ``counters()`` says how many bytes went each way
(``straight_bytes``, ``bounced_bytes``).

Destinations are writable C-contiguous buffers of exactly the request's length: NumPy arrays, CPU torch tensors,
``mmap`` slices, ``bytearray``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import config
from ..native import abi
from ..native.cpu import library
from ..native.cpu_binding import (GLM53_DR_SHORT_READ, GLM53_DR_SLOW_READ, GLM53_DR_SLOW_READ_MS, glm53_dr_counter,
                                  glm53_dr_request, glm53_dr_state)

log = logging.getLogger(__name__)

# a multiple of every logical block size in use (512, 4096): O_DIRECT's offset, length and memory alignment where the
# kernel reports none, and the coarsest grid a file's reads are cut on
ALIGN = 4096
# one pread (a unit of work for any thread) and each thread's bounce buffer; the threads: preads in flight
PIECE_BYTES = config.default_of("disk_piece_kb") * 1024
THREADS = config.default_of("disk_threads")
CPU_SETSIZE = 1024  # the CPUs a native cpu_set_t holds: as many as a thread's CPUs can be
SLOW, SLOW_READ_MS = "slow", GLM53_DR_SLOW_READ_MS  # an injected fault: a read that waits, then reads
STATES = abi.names(glm53_dr_state, "GLM53_DR_")  # by id: pending, done, failed
DONE, FAILED = STATES.index("done"), STATES.index("failed")
COUNTERS = abi.names(glm53_dr_counter, "GLM53_DR_C_", "GLM53_DR_C_N")  # requests, failed, bytes, disk_bytes, ..., pieces


@dataclass(frozen=True)
class Read:
    """``length`` bytes of file ``file`` (an index into the reader's paths) at ``offset``, into ``dest``."""

    file: int
    offset: int
    length: int
    dest: object


class DiskReadError(OSError):
    """A read that failed; the message names the file, the offset and what to do. ``request`` is its index in the
    submission, ``failed_at`` the file byte it stopped at, ``truncated`` whether the file ended there (errno EIO)."""

    def __init__(self, message: str, errno_value: int, path: Path, request: int, offset: int, failed_at: int, truncated: bool):
        super().__init__(errno_value, message, str(path))
        self.message, self.path, self.request, self.offset, self.failed_at = message, path, request, offset, failed_at
        self.truncated = truncated

    def __str__(self) -> str:
        return self.message


class Batch:
    """Submitted reads in flight; :meth:`wait` for them. Keeps their destinations alive until then."""

    def __init__(self, reader: DiskReader, reads: Sequence[Read], requests, keep: list):
        self.reader, self.reads, self._requests, self._keep = reader, list(reads), requests, keep

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once every read has finished (done or failed); False when ``timeout_s`` passed first."""
        timeout_us = -1 if timeout_s is None else max(0, int(timeout_s * 1e6))
        finished = library().glm53_dr_wait(self.reader._handle, self._requests, len(self.reads), timeout_us) == 0
        self.reader._warn_fallbacks()
        return finished

    def errors(self) -> list[DiskReadError]:
        """The failed reads (after :meth:`wait`), in submission order."""
        return [self.reader._error(i, r, self._requests[i]) for i, r in enumerate(self.reads) if self._requests[i].state == FAILED]

    def done(self) -> list[bool]:
        """Per read, whether its bytes are all in its destination."""
        return [self._requests[i].state == DONE for i in range(len(self.reads))]

    def cancel(self, which: Sequence[int] | None = None) -> None:
        """Drop the pieces no thread has begun of the reads ``which`` (indices; None: all). Those reads fail with
        ECANCELED once their pieces in flight are done, unless none was left to drop (they finish as they would have):
        :meth:`wait`, then :meth:`done` says which hold their bytes."""
        self.reader._open()
        if which is None:
            library().glm53_dr_cancel(self.reader._handle, self._requests, len(self.reads))
            return
        size = ctypes.sizeof(glm53_dr_request)
        base = ctypes.addressof(self._requests)
        for i in which:
            library().glm53_dr_cancel(self.reader._handle, ctypes.cast(base + i * size, ctypes.POINTER(glm53_dr_request)), 1)


class DiskReader:
    """A pool of ``threads`` reading ``paths`` (opened now, with ``O_DIRECT`` when ``direct``).

    :raise OSError: a path that cannot be opened (the message names it).
    :raise ValueError: threads < 1, or an ``align`` that is not a power of two dividing ``piece_bytes``.
    """

    def __init__(self, paths: Sequence[Path | str], threads: int = THREADS, direct: bool = True, align: int = ALIGN,
                 piece_bytes: int = PIECE_BYTES):
        if threads < 1 or align < 1 or align & (align - 1) or piece_bytes < align or piece_bytes % align:
            raise ValueError(f"threads {threads} must be >= 1, align {align} a power of two, piece_bytes {piece_bytes} a multiple of it")
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("a disk reader needs at least one file")
        lib = library()
        names = (ctypes.c_char_p * len(self.paths))(*(os.fsencode(p) for p in self.paths))
        self._handle = lib.glm53_dr_start(names, len(self.paths), threads, int(direct), align, piece_bytes)
        if not self._handle:
            raise OSError(lib.glm53_dr_error().decode())
        self.threads, self.align, self.piece_bytes, self.asked_direct = threads, align, piece_bytes, direct
        self._warned = False

    # ---- reading

    def submit(self, reads: Sequence[Read], piece_bytes: int = 0) -> Batch:
        """Start ``reads``, cut into pieces of ``piece_bytes`` (0: the reader's; else a multiple of ``align`` up to
        the reader's: what a :meth:`Batch.cancel` leaves in flight is at most a piece a thread); returns at once.

        :raise ValueError: a file index out of range, a negative offset, a length below 1, a destination that is
            not a writable contiguous buffer of exactly ``length`` bytes, or a piece size the reader cannot take.
        """
        self._open()
        requests = (glm53_dr_request * max(1, len(reads)))()
        keep = []
        for i, r in enumerate(reads):
            if not 0 <= r.file < len(self.paths):
                raise ValueError(f"read {i}: file {r.file} is not one of the reader's {len(self.paths)} files")
            if r.offset < 0 or r.length < 1:
                raise ValueError(f"read {i}: offset {r.offset} must be >= 0 and length {r.length} >= 1")
            dest = _buffer(r.dest, r.length, i)
            keep.append(dest)
            requests[i] = glm53_dr_request(dest.ctypes.data, r.offset, r.length, r.file)
        if reads and library().glm53_dr_submit(self._handle, requests, len(reads), piece_bytes) != 0:
            raise ValueError(library().glm53_dr_error().decode())
        return Batch(self, reads, requests, keep)

    def read(self, reads: Sequence[Read]) -> None:
        """Read and wait. Every read is finished when this returns or raises.

        :raise DiskReadError: the first failed read (the others' bytes are in place; ``Batch.errors`` has them all).
        """
        batch = self.submit(reads)
        batch.wait()
        errors = batch.errors()
        if errors:
            raise errors[0]

    # ---- what happened

    def direct(self, file: int) -> bool:
        """Whether ``file`` is read with O_DIRECT (False when asked for buffered reads, or after a fallback)."""
        self._open()
        return library().glm53_dr_file_direct(self._handle, file) == 1

    def dio_alignment(self, file: int) -> tuple[int, int]:
        """``(memory, file offset)`` alignment of ``file``'s O_DIRECT reads: the kernel's (``statx`` STATX_DIOALIGN)
        where it reports them no coarser than ``align``, else ``align`` for both (also for a file read buffered). The
        offset alignment is the grid the file's reads are cut on.

        :raise ValueError: no such file.
        """
        return self._alignment(file)[:2]

    def summary(self) -> dict:
        """The files as read (for stats): how many, how many with O_DIRECT, and the direct files' alignments
        (``"memory/offset B"``, ``", assumed"`` added where the kernel reported none) with how many have each."""
        alignments: dict[str, int] = {}
        direct = [i for i in range(len(self.paths)) if self.direct(i)]
        for i in direct:
            mem, offset, reported = self._alignment(i)
            key = f"{mem}/{offset} B{'' if reported else ', assumed'}"
            alignments[key] = alignments.get(key, 0) + 1
        return {"files": len(self.paths), "o_direct": len(direct), "dio_alignment": alignments}

    def describe(self) -> str:
        """:meth:`summary` in words, for a log line: ``buffered``, or ``O_DIRECT`` with the alignments found."""
        files = self.summary()
        if files["o_direct"] == 0:
            return "buffered"
        share = "" if files["o_direct"] == files["files"] else f" on {files['o_direct']} of {files['files']} files"
        kinds = files["dio_alignment"]
        found = "; ".join(a if len(kinds) == 1 else f"{a} ({n} files)" for a, n in kinds.items())
        return f"O_DIRECT{share}, memory/offset alignment {found}"

    def counters(self) -> dict[str, int]:
        """Requests finished and failed, bytes delivered, bytes read from disk (the blocks the requests cover, with
        O_DIRECT), bytes copied out of a bounce buffer and bytes read straight into destinations (both with O_DIRECT),
        retried errors, continued short reads, files fallen back to buffered reads, pieces read (the units the threads
        share)."""
        self._open()
        out = (ctypes.c_uint64 * len(COUNTERS))()
        library().glm53_dr_counters(self._handle, out)
        return dict(zip(COUNTERS, (int(v) for v in out)))

    # ---- where the threads run

    def set_cpus(self, cpus: Sequence[int] | None) -> None:
        """Move every reader thread to ``cpus`` (empty or None: back to the CPUs of the thread that started the
        reader, those this process may use), as far as the process may use them: to keep the threads off the CPUs
        that compute threads are pinned to.

        :raise ValueError: a CPU out of range, or none of ``cpus`` one this process may use (the threads stay put).
        """
        self._open()
        chosen = [int(c) for c in cpus or ()]
        array = (ctypes.c_int32 * max(1, len(chosen)))(*chosen)
        if library().glm53_dr_set_cpus(self._handle, array, len(chosen)) != 0:
            raise ValueError(library().glm53_dr_error().decode())

    def cpus(self) -> list[set[int]]:
        """Each reader thread's CPUs, as the kernel has them."""
        self._open()
        array = (ctypes.c_int32 * CPU_SETSIZE)()
        return [set(array[:library().glm53_dr_thread_cpus(self._handle, t, array, CPU_SETSIZE)]) for t in range(self.threads)]

    def inject(self, file: int, offset: int, error: int | str | None, times: int = 1) -> None:
        """Tests' faults: the next ``times`` reads of ``file`` covering ``offset`` fail with errno ``error`` (None:
        they return half the bytes asked; :data:`SLOW`: they wait ``SLOW_READ_MS`` first, keeping a thread busy)."""
        self._open()
        code = GLM53_DR_SHORT_READ if error is None else GLM53_DR_SLOW_READ if error == SLOW else error
        if library().glm53_dr_inject(self._handle, file, offset, code, times) != 0:
            raise ValueError(library().glm53_dr_error().decode())

    def close(self) -> None:
        """Wait for the reads in flight and close the files."""
        if self._handle:
            library().glm53_dr_stop(self._handle)
            self._handle = None

    def __enter__(self) -> DiskReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- messages

    def _open(self) -> None:
        if not self._handle:
            raise ValueError("the disk reader is closed")

    def _alignment(self, file: int) -> tuple[int, int, bool]:
        self._open()
        mem, offset = ctypes.c_uint64(), ctypes.c_uint64()
        reported = library().glm53_dr_file_alignment(self._handle, file, ctypes.byref(mem), ctypes.byref(offset))
        if reported < 0:
            raise ValueError(f"file {file} is not one of the reader's {len(self.paths)} files")
        return mem.value, offset.value, reported == 1

    def _error(self, index: int, read: Read, request: glm53_dr_request) -> DiskReadError:
        path, at = self.paths[read.file], int(request.error_offset)
        what = f"{path}: reading {read.length} bytes at byte {read.offset}"
        if request.error == 0:
            size = _size(path)
            message = (f"{what} failed: the file ends at byte {at}{f' (it is {size} bytes now)' if size is not None else ''}, "
                       f"before the read's last byte {read.offset + read.length - 1}: the file is truncated or was changed "
                       "while being served; fetch the checkpoint again and restart")
            return DiskReadError(message, errno.EIO, path, index, read.offset, at, True)
        if request.error == errno.ECANCELED:
            return DiskReadError(f"{what} was cancelled (Batch.cancel) at byte {at}", errno.ECANCELED, path, index, read.offset, at, False)
        name = errno.errorcode.get(request.error, str(request.error))
        message = (f"{what} failed at byte {at} with {name} ({os.strerror(request.error)}), also when retried: the disk or "
                   "its filesystem failed there; check the kernel log (dmesg) and the drive's health (smartctl -a), or move "
                   "the checkpoint to another disk and restart")
        return DiskReadError(message, request.error, path, index, read.offset, at, False)

    def _warn_fallbacks(self) -> None:
        if self._warned or not self.asked_direct or not self._handle:
            return
        lib = library()
        refused = []
        for i, path in enumerate(self.paths):
            where = ctypes.c_int64()
            err = lib.glm53_dr_file_fallback(self._handle, i, ctypes.byref(where))
            if err:
                refused.append((path, err, where.value))
        if refused:
            self._warned = True
            path, err, where = refused[0]
            at = "opening it" if where < 0 else f"a read at byte {where}"
            more = f" (and {len(refused) - 1} more of its {len(self.paths)} files)" if len(refused) > 1 else ""
            log.warning("%s%s refused O_DIRECT (%s at %s): reading buffered, so each expert read from disk passes through "
                        "the page cache too; keep the checkpoint on a filesystem with O_DIRECT (ext4, xfs, btrfs) for "
                        "direct reads", path, more, errno.errorcode.get(err, str(err)), at)


def _buffer(dest, length: int, index: int) -> np.ndarray:
    if hasattr(dest, "numpy") and not isinstance(dest, np.ndarray):
        dest = dest.numpy()  # a CPU torch tensor
    array = dest if isinstance(dest, np.ndarray) else np.frombuffer(dest, dtype=np.uint8)
    if not (array.flags.c_contiguous and array.flags.writeable) or array.nbytes != length:
        raise ValueError(f"read {index}: the destination must be a writable contiguous buffer of {length} bytes, "
                         f"not {array.nbytes} bytes{'' if array.flags.writeable else ', read-only'}")
    return array


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
