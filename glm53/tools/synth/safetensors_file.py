"""A minimal safetensors writer: a header planned up front, tensor bytes streamed after it (the reader of headers
is ``models/safetensors_header``, which ``overwrite_tensor`` uses).

File layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes of
JSON mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the end of the header), then the data, contiguous and in offset order. The JSON is padded with spaces to a
multiple of 8 so the data starts 8-aligned; every tensor here has a size that is a multiple of 4, so 4-byte
dtypes stay aligned too (checked when the header is made).

Because the header needs every size first, a shard is described by its (name, dtype, shape) list, then its
tensors are written in exactly that order from any iterator of byte chunks: nothing holds a whole tensor.
"""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ...models.safetensors_header import read_header

DTYPE_SIZES = {"F16": 2, "BF16": 2, "F32": 4, "I16": 2, "I32": 4}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def encode_header(entries: Sequence[Entry]) -> bytes:
    """The length prefix and JSON header for ``entries`` laid out back to back, in order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        if offset % DTYPE_SIZES[e.dtype]:
            raise ValueError(f"{e.name} would start at offset {offset}, not aligned for {e.dtype}")
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


class ShardWriter:
    """The open shard of :func:`open_shard`: ``write`` each entry's bytes in the order the header lists them."""

    def __init__(self, file: BinaryIO, entries: Sequence[Entry]) -> None:
        self._file = file
        self._pending = list(reversed(entries))
        header = encode_header(entries)
        _reserve(file, len(header) + sum(e.nbytes for e in entries))
        file.write(header)
        self.data_bytes = 0

    def write(self, name: str, chunks: Iterable) -> None:
        """Stream the bytes of the next tensor, which must be ``name``, from ``chunks`` (anything with the buffer
        protocol: bytes, numpy arrays); their total size must match the entry."""
        entry = self._pending.pop()
        if entry.name != name:
            raise ValueError(f"expected tensor {entry.name}, got {name}")
        written = 0
        for chunk in chunks:
            written += self._file.write(chunk)
        if written != entry.nbytes:
            raise ValueError(f"{name}: wrote {written} bytes, header says {entry.nbytes}")
        self.data_bytes += written

    def check_complete(self) -> None:
        if self._pending:
            raise ValueError(f"{len(self._pending)} tensors not written, first {self._pending[-1].name}")


@contextmanager
def open_shard(path: Path, entries: Sequence[Entry]) -> Iterator[ShardWriter]:
    """Write one shard of ``entries``; every entry must be written before the block ends.

    The file is written under a ``.partial`` name and renamed when complete (and deleted on an error), so an
    interrupted run never leaves a truncated shard under a name a loader would pick up.
    """
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as file:
            shard = ShardWriter(file, entries)
            yield shard
            shard.check_complete()
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def _reserve(file, nbytes: int) -> None:
    """Allocate the file's final size up front: a full disk fails here rather than mid-shard, and the
    filesystem can lay the shard out in few extents (measured: page-cache writes ran faster after it)."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(file.fileno(), 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise


def overwrite_tensor(path: Path, name: str, dtype: str, data: bytes) -> None:
    """Replace the bytes of tensor ``name`` in place; its dtype and byte size must stay the same.

    :raise KeyError: no such tensor in the file.
    :raise ValueError: a different dtype or size.
    """
    header, start = read_header(path)
    entry = header[name]
    begin, end = entry["data_offsets"]
    if entry["dtype"] != dtype or end - begin != len(data):
        raise ValueError(
            f"{name} is {entry['dtype']} of {end - begin} bytes in {path.name}; refusing {dtype} of {len(data)} bytes"
        )
    with open(path, "r+b") as f:
        f.seek(start + begin)
        f.write(data)
