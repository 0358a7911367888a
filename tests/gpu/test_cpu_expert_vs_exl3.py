"""The CPU tier's expert kernel against exllamav3 1.6.5 on the GPU, on the same random EXL3 tensors.

- Codebook and tile layout: exllamav3's reconstructed W_hat (``get_inner_weight_tensor``, fp16) equals, bit for
  bit, the GPU codebook (one fp16 fma: (1024 + byte sum) * fp16 0x1eee + fp16 0xc931) applied to the states
  exl3_reference reads from the trellis. The kernel (like exl3_reference and exllamav3's own CPU kernel) uses
  the exact (byte sum - 510) * 0x1eee instead. 0xc931 is -10.3828125 where -1534 * 0x1eee is -10.38100, so every
  GPU weight sits 476 / 2^18 = 1.8e-3 lower, plus its fp16 rounding (2.1e-4 RMS); on random data that moves a
  projection's output by 1.5e-3 to 5e-3 (relative RMS), the shift alone all but 2e-4 of it.
- One projection: the kernel against x @ W built in float64 from exllamav3's own W_hat, and against exllamav3's
  GEMM (``LinearEXL3.forward``, fp16 activations inside).
- One expert: against exllamav3's composition of it (gate and up ``forward``, ``ext.silu_mul`` with act_limit,
  down ``forward``) at GLM's limit 10, and at a limit of 1, where clamping the gate after SiLU (exllamav3, and
  the kernel) and before it differ on many elements.

The printed figures are relative RMS errors; run with ``-rA`` to see them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from glm53.models.synth import exl3_reference as ref
from glm53.offload import cpu_expert as ce
from tests.native.exl3_float64 import (
    Reference,
    random_expert,
    random_linear,
    rel_rms,
    w_hat64,
)

SEED = int.from_bytes(os.urandom(4), "little")
HIDDEN, INTER = 4096, 2048
K_BIAS = float(np.array(0xC931, np.uint16).view(np.float16))  # -10.39 = (-1024 - 510) * 0x1eee, rounded to fp16
GPU_SHIFT = -476 / 2**18  # K_BIAS + 1534 * K_INV: how much lower than the exact codebook every GPU weight is


def exl3_linear(lin: ce.Linear):
    from exllamav3.modules.quant.exl3 import LinearEXL3

    mul1 = torch.tensor(int(np.array(ref.MUL1_MULT, np.uint32).view(np.int32)), dtype=torch.int32)
    return LinearEXL3(None, lin.in_features, lin.out_features, suh=torch.from_numpy(lin.suh).cuda(),
                      svh=torch.from_numpy(lin.svh).cuda(), trellis=torch.from_numpy(lin.trellis).cuda(),
                      mul1=mul1.cuda(), out_dtype=torch.float)


def gpu_codebook_w_hat(trellis: np.ndarray) -> np.ndarray:
    """W_hat [in, out] as exllamav3's kernels decode it: fp16, one rounding of an exact fma."""
    x = ref.decode_states(trellis).astype(np.uint32) * np.uint32(ref.MUL1_MULT)
    byte_sum = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
    values = ((1024.0 + byte_sum) * ref.K_INV + K_BIAS).astype(np.float16)  # exact in float64, then fp16
    tiles = np.empty_like(values)
    tiles[..., ref.tc_perm()] = values
    k, n = trellis.shape[:2]
    return tiles.reshape(k, n, 16, 16).transpose(0, 2, 1, 3).reshape(k * 16, n * 16)


@pytest.fixture
def rng():
    print(f"seed {SEED}")
    return np.random.default_rng(SEED)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_projection_matches_exllamav3(rng, bits):
    lin = random_linear(rng, HIDDEN, INTER, bits, 1.0)
    exl = exl3_linear(lin)
    w_exl = exl.get_inner_weight_tensor().cpu().numpy()
    assert np.array_equal(w_exl, gpu_codebook_w_hat(lin.trellis)), "tile layout or codebook differs from exllamav3"

    x = rng.normal(size=(3, HIDDEN)).astype(np.float16).astype(np.float32)  # representable in the GPU's fp16
    y = np.empty((3, INTER), np.float32)
    ce.linear_forward(x, lin, y)
    reference = Reference()
    x64 = x.astype(np.float64)
    y_exl_weights = reference.rotated(x64, w_exl, lin.suh, lin.svh)
    err_exact = rel_rms(y, reference.linear(x64, lin)).max()
    err_weights = rel_rms(y, y_exl_weights).max()
    err_unshifted = rel_rms(reference.rotated(x64, w_hat64(lin.trellis) + GPU_SHIFT, lin.suh, lin.svh), y_exl_weights).max()
    y_gpu = exl.forward(torch.from_numpy(x).half().cuda(), {}, out_dtype=torch.float).cpu().numpy()
    err_gemm = rel_rms(y, y_gpu).max()
    print(f"K={bits}: vs float64 {err_exact:.2e}; vs float64 with exllamav3's fp16 W_hat {err_weights:.2e} "
          f"({err_unshifted:.2e} with the GPU's codebook shift); vs exllamav3's GEMM {err_gemm:.2e}")
    assert err_exact < 2e-6
    assert err_unshifted < 5e-4, "more than the codebook shift and fp16 rounding separates the weights"
    assert err_weights < 1e-2
    assert err_gemm < 1.5e-2


@pytest.mark.parametrize("limit", [10.0, 1.0])
def test_expert_matches_exllamav3(rng, limit):
    from exllamav3.ext import exllamav3_ext as ext

    expert = random_expert(rng, HIDDEN, INTER, 3)
    x = rng.normal(size=(3, HIDDEN)).astype(np.float16)
    w = rng.uniform(0.1, 1.0, 3).astype(np.float32)
    out = np.zeros((3, HIDDEN), np.float32)
    ce.expert_forward(x, *expert, w, out, act_limit=limit)

    gate, up, down = (exl3_linear(lin) for lin in expert)
    xg = torch.from_numpy(x).cuda()
    g = gate.forward(xg, {}, out_dtype=torch.float)
    u = up.forward(xg, {}, out_dtype=torch.float)
    a = torch.empty(g.shape, dtype=torch.half, device=g.device)
    ext.silu_mul(g, u, a, limit)
    want = (down.forward(a, {}, out_dtype=torch.float).cpu().numpy()) * w[:, None]

    err = rel_rms(out, want).max()
    gate_first, _, _ = Reference().expert(x, expert, limit, clamp_gate_first=True)
    err_gate_first = rel_rms(w[:, None] * gate_first, want).max()
    print(f"limit {limit}: kernel vs exllamav3 {err:.2e}; clamping the gate before SiLU instead: {err_gate_first:.2e}")
    assert err < 2e-2
    if limit == 1.0:
        assert err_gate_first > 10 * err, "the clamp order cannot be told apart"
