"""Fast, deterministic random bytes for tensors of any size: windows of one random pool, XOR-masked.

A checkpoint is tens of GB of random values; drawing every byte from numpy's PCG64 runs at ~0.4 GB/s on one
core here, and fp16 normals at ~0.1 GB/s. Instead a source draws one pool of random 64-bit words (and one of
normals) from the seed once, and a tensor is streamed as chunks of at most ``CHUNK_BYTES``: chunk ``j`` of the tensor
named ``name`` is the pool window at offset ``h1`` XOR the 64-bit word ``h2``, where ``(h1, h2)`` are
SplitMix64 outputs of a key hashed from (seed, name) and ``j``. Producing a chunk is one vectorised XOR.

Properties this gives:
- deterministic from (seed, name), independent of the order tensors are written in;
- two tensors (two experts) differ in practically every word: word i of windows at offsets o1, o2 with masks
  m1, m2 agrees only if ``pool[o1+i] ^ pool[o2+i] == m1 ^ m2``, a 2^-64 chance;
- no tensor repeats itself with the pool's period, since every chunk takes a fresh window and mask.

Normal values come from a scaled copy of the normal pool (one per (std, dtype), made on first use) with the
mask restricted to the sign bits, so a window is still a Gaussian sample; windows of different tensors may
overlap up to sign, which is harmless for random weights. Small tensors that need a distribution of their own
draw from :meth:`RandomSource.generator`, a Philox stream keyed the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

POOL_WORDS = 8 << 20  # 64 MiB of random words
NORMAL_COUNT = 4 << 20  # normals per scaled pool (8 MiB as fp16; a chunk window is at most 4 MiB)
CHUNK_BYTES = 4 << 20
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# The sign bits of the 16-bit (F16, BF16) and 32-bit (F32) lanes of a 64-bit word.
_SIGN_BITS = {"F16": 0x8000800080008000, "BF16": 0x8000800080008000, "F32": 0x8000000080000000}


def splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele et al.): a bijective 64-bit mixer."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def name_key(seed: int, name: str) -> int:
    """64-bit key of ``name`` under ``seed``: a keyed BLAKE2b, so stable across processes and platforms."""
    digest = hashlib.blake2b(name.encode(), digest_size=8, key=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little")


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 ``values``, rounded to nearest even."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


class RandomSource:
    """The random values of one checkpoint, all derived from ``seed``."""

    def __init__(self, seed: int) -> None:
        if not 0 <= seed < 1 << 63:
            raise ValueError(f"seed must be in 0..2^63-1, got {seed}")
        self.seed = seed
        bitgen = np.random.PCG64(seed)
        self._words = bitgen.random_raw(POOL_WORDS).astype(np.uint64)  # [POOL_WORDS]
        self._normal = np.random.Generator(bitgen).standard_normal(NORMAL_COUNT, dtype=np.float32)
        self._scaled: dict[tuple[float, str], np.ndarray] = {}
        self._buf = np.empty(CHUNK_BYTES // 8, dtype=np.uint64)

    def key(self, name: str) -> int:
        return name_key(self.seed, name)

    def generator(self, name: str) -> np.random.Generator:
        """An independent generator for a small tensor that needs its own distribution."""
        return np.random.Generator(np.random.Philox(key=self.key(name)))

    def bits(self, name: str, nbytes: int) -> Iterator[np.ndarray]:
        """Uniform random bytes for ``name``, as uint8 chunks of at most CHUNK_BYTES (valid until the next)."""
        yield from self._windows(self._words, self.key(name), nbytes, _MASK64)

    def normal(self, name: str, count: int, std: float, dtype: str) -> Iterator[np.ndarray]:
        """``count`` N(0, std^2) values stored as ``dtype`` (F16, BF16 or F32), as uint8 chunks."""
        pool = self._scaled_pool(std, dtype)
        itemsize = 4 if dtype == "F32" else 2
        yield from self._windows(pool, self.key(name), count * itemsize, _SIGN_BITS[dtype])

    def _windows(self, pool: np.ndarray, key: int, nbytes: int, mask_bits: int) -> Iterator[np.ndarray]:
        for j, start in enumerate(range(0, nbytes, CHUNK_BYTES)):
            n = min(CHUNK_BYTES, nbytes - start)
            words = -(-n // 8)
            h1 = splitmix64(key ^ (j * _GOLDEN & _MASK64))
            h2 = splitmix64(h1)
            offset = h1 % (len(pool) - words + 1)
            out = self._buf[:words]
            np.bitwise_xor(pool[offset : offset + words], np.uint64(h2 & mask_bits), out=out)
            yield out.view(np.uint8)[:n]

    def _scaled_pool(self, std: float, dtype: str) -> np.ndarray:
        """The normal pool times ``std`` in ``dtype``'s bits, viewed as uint64 words."""
        pool = self._scaled.get((std, dtype))
        if pool is None:
            values = self._normal * np.float32(std)
            if dtype == "F16":
                pool = values.astype(np.float16).view(np.uint64)
            elif dtype == "BF16":
                pool = to_bf16_bits(values).view(np.uint64)
            elif dtype == "F32":
                pool = values.view(np.uint64)
            else:
                raise ValueError(f"no normal pool for dtype {dtype}")
            self._scaled[(std, dtype)] = pool
        return pool
