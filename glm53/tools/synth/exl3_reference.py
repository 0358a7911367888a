"""NumPy reference decoder for EXL3 linears with the mul1 codebook, for checking written tensors on a CPU.

Transcribed from the scalar path of exllamav3 1.6.5's CPU expert kernel (``exllamav3_ext/cpu/moe_mul1.cpp``:
``make_tc_perm``, ``state_end``, ``decode_state_scalar``, ``decode_mul1_scalar``, the input preparation and
``transform_out``), which reads the on-disk tile layout:

- ``trellis[kt, nt]`` is one 16x16 tile of K-bit codes, 16*K uint16 words read as 8*K little-endian uint32
  words forming a tail-biting bit ring, most significant bit first.
- State ``t`` (0..255) of a tile is the 16-bit window ending at ring bit ``(t + 1) * K``; it is the weight at
  tile position ``tc_perm()[t]`` (= row * 16 + column, row along the input).
- mul1 codebook: ``x = state * 0x83DCD12D`` (32-bit), value ``(sum of x's four bytes - 510) / 147.7``. That is the
  exact codebook (``mul1_values``, used by the synthetic checkpoints' writer); exllamav3's GPU kernels and its
  quantiser decode ``fp16(fma(1024 + byte sum, fp16 0x1eee, fp16 0xc931))`` instead (``mul1_values_gpu``), which
  sits 476 / 2^18 ~ 1.8e-3 lower plus its fp16 rounding (``native/cpu_expert/format.h`` has the derivation).
- The layer computes ``y = svh * H(H(suh * x) . W_hat) / 128`` with ``H`` the 128-point Hadamard transform on
  each 128-block, so its dense weight is ``diag(suh) Hb W_hat Hb diag(svh) / 128``.
"""

from __future__ import annotations

import numpy as np

MUL1_MULT = 0x83DCD12D
K_INV = float(np.array(0x1EEE, dtype=np.uint16).view(np.float16))  # fp16 0x1eee ~ 1/147.7
K_BIAS_GPU = float(np.array(0xC931, dtype=np.uint16).view(np.float16))  # fp16 0xc931 = -10.3828125 (not -1534 K_INV)


def tc_perm() -> np.ndarray:
    """Tile position (row * 16 + column) of each of the 256 states, the tensor-core fragment order."""
    perm = np.empty(256, dtype=np.int64)
    for t in range(32):
        r0, c0 = (t % 4) * 2, t // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for half, c in enumerate((c0, c0 + 8)):
            for i, r in enumerate(rows):
                perm[t * 8 + half * 4 + i] = r * 16 + c
    return perm


def decode_states(trellis: np.ndarray) -> np.ndarray:
    """The 256 16-bit states of every tile: uint16 [..., 256] from int16 trellis [..., 16 * K] (integer K)."""
    k = trellis.shape[-1] // 16
    words = trellis.view(np.uint16).reshape(*trellis.shape[:-1], 8 * k, 2).astype(np.uint64)
    ring = words[..., 0] | (words[..., 1] << np.uint64(16))  # [..., 8K] uint32 words of the bit ring
    end = (np.arange(1, 257) * k) + 256 * k  # one ring length added so the window start stays positive
    start = end - 16
    first, last = (start // 32) % (8 * k), ((end - 1) // 32) % (8 * k)
    shift = ((end - 1) // 32 + 1) * 32 - end
    merged = (ring[..., first] << np.uint64(32)) | ring[..., last]
    return ((merged >> shift.astype(np.uint64)) & np.uint64(0xFFFF)).astype(np.uint16)


def mul1_values(states: np.ndarray) -> np.ndarray:
    """The mul1 codebook value of each state, float32."""
    x = states.astype(np.uint32) * np.uint32(MUL1_MULT)  # wraps mod 2^32 like the kernel's uint32 product
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
    return ((byte_sum.astype(np.float32) - 510.0) * np.float32(K_INV)).astype(np.float32)


def mul1_values_gpu(states: np.ndarray) -> np.ndarray:
    """The mul1 value of each state as exllamav3's GPU kernels decode it (``decode_3inst<2>`` in
    ``quant/codebook.cuh``), float16: ``h = 1024 + byte sum`` as an fp16 (exact), then one fp16 fused
    multiply-add ``h * 0x1eee + 0xc931`` rounded once to nearest even. The product and sum are exact in float64
    (11-bit operands), so NumPy's float64 -> float16 conversion is that single rounding."""
    x = states.astype(np.uint32) * np.uint32(MUL1_MULT)
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
    h = (1024 + byte_sum).astype(np.float16)
    return (h.astype(np.float64) * K_INV + K_BIAS_GPU).astype(np.float16)


def mul1_values_gpu_unrounded(states: np.ndarray) -> np.ndarray:
    """The GPU's fused multiply-add of :func:`mul1_values_gpu` before its rounding to fp16, float64 (exact): the
    CPU tier's ``fma`` codebook (``glm53.cpu_tier.kernel``)."""
    x = states.astype(np.uint32) * np.uint32(MUL1_MULT)
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
    return (1024 + byte_sum).astype(np.float64) * K_INV + K_BIAS_GPU


def decode_tiles(trellis: np.ndarray) -> np.ndarray:
    """The codebook weights W_hat, float32 [in, out], before the Hadamard rotations and scales."""
    tiles_k, tiles_n = trellis.shape[:2]
    values = mul1_values(decode_states(trellis))  # [tiles_k, tiles_n, 256], state order
    tiles = np.empty_like(values)
    tiles[..., tc_perm()] = values  # [tiles_k, tiles_n, row * 16 + column]
    return tiles.reshape(tiles_k, tiles_n, 16, 16).transpose(0, 2, 1, 3).reshape(tiles_k * 16, tiles_n * 16)


def hadamard_128() -> np.ndarray:
    """The Sylvester Hadamard matrix of order 128 (entries +-1, symmetric, H @ H = 128 I)."""
    h = np.ones((1, 1), dtype=np.float32)
    while len(h) < 128:
        h = np.block([[h, h], [h, -h]])
    return h


def dense_weight(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray) -> np.ndarray:
    """The layer's weight as a float32 [in, out] matrix: ``y = x @ W`` for one input row ``x``."""
    w = decode_tiles(trellis)
    n_in, n_out = w.shape
    h = hadamard_128() / np.float32(np.sqrt(128.0))
    w = (h @ w.reshape(n_in // 128, 128, n_out)).reshape(n_in, n_out)  # rotate the input side per 128-block
    w = (w.reshape(n_in, n_out // 128, 128) @ h).reshape(n_in, n_out)  # and the output side
    return suh.astype(np.float32)[:, None] * w * svh.astype(np.float32)[None, :]
