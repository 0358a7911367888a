"""The header of a safetensors file: what the host store and the checkpoint facts read, and what the synthetic
writer (``synth/safetensors_file``) checks what it wrote against.

Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, then N bytes of JSON
mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets from the end of the
header), then the data.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1024**2  # the reference implementation's (and exllamav3's) limit


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors file (without ``__metadata__``) and the offset its data starts at.

    :raise ValueError: a header length that is out of range.
    """
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} out of range")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n
