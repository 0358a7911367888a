"""The CPU tier's expert kernel against exllamav3 1.6.5 on the GPU, on the same random EXL3 tensors.

- Codebook and tile layout: exllamav3's reconstructed W_hat (``get_inner_weight_tensor``, fp16) equals, bit for
  bit, the GPU codebook (one fp16 fma: (1024 + byte sum) * fp16 0x1eee + fp16 0xc931, emulated by
  exl3_reference.mul1_values_gpu) applied to the states exl3_reference reads from the trellis. The kernel decodes
  exactly these values (native/cpu_expert/format.h; tests/cpu_tier/test_kernel.py checks every state), so against x @ W_hat in
  float64 it is off by its fp32 arithmetic only. The exact codebook (byte sum - 510) * 0x1eee would be 1.5e-3 to
  5e-3 off (printed for reference): 0xc931 puts every GPU weight 476 / 2^18 = 1.8e-3 lower.
- One projection against exllamav3's dense weight (``get_weight_tensor``, fp16): that weight is rounded to fp16
  four times (after each Hadamard and each sign/scale product), which exl3_dense_weight64 emulates on the CPU;
  the emulation gives 4.0e-4 to 4.4e-4 (relative RMS, K = 2..4, measured on the CPU) for the kernel against
  x @ W, and the bound is 3x that. Against exllamav3's GEMM (``LinearEXL3.forward``) the bound stays loose: at
  m <= 8 and K <= 6 on Hopper that is the int8-activation GEMV (EXL3_INT8_GEMV=2, the CUDA default, about 0.9 %
  output RMS deviation by its own account).
- One expert, with the kernel's fp16 codebook and with the tier's int16 one: against exllamav3's composition of it (gate and up ``forward``, ``ext.silu_mul`` with act_limit,
  down ``forward``) at GLM's limit 10, and at a limit of 1, where clamping the gate after SiLU (exllamav3, and
  the kernel) and before it differ on many elements.

The printed figures are relative RMS errors; run with ``-rA`` to see them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from glm53.tools.synth import exl3_reference as ref
from glm53.cpu_tier import kernel as ce
from tests.cpu_tier.exl3_float64 import (
    Reference,
    random_expert,
    random_linear,
    rel_rms,
    w_hat64,
)

SEED = int.from_bytes(os.urandom(4), "little")
HIDDEN, INTER = 4096, 2048
TOLERANCE = 2e-6  # the kernel's fp32 arithmetic against float64 (tests/cpu_tier/test_kernel.py)
DENSE_BOUND = 1.3e-3  # 3x the 4.0e-4 to 4.4e-4 of the emulated fp16 roundings of get_weight_tensor


def exl3_linear(lin: ce.Linear):
    from exllamav3.modules.quant.exl3 import LinearEXL3

    mul1 = torch.tensor(int(np.array(ref.MUL1_MULT, np.uint32).view(np.int32)), dtype=torch.int32)
    return LinearEXL3(None, lin.in_features, lin.out_features, suh=torch.from_numpy(lin.suh).cuda(),
                      svh=torch.from_numpy(lin.svh).cuda(), trellis=torch.from_numpy(lin.trellis).cuda(),
                      mul1=mul1.cuda(), out_dtype=torch.float)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def exl3_dense_weight64(lin: ce.Linear) -> np.ndarray:
    """exllamav3's ``get_weight_tensor`` emulated in float64 [in, out]: W_hat (the GPU codebook, fp16), then
    preapply_had_l (Hadamard / sqrt(128) in fp32 there) to fp16, times suh in fp16, preapply_had_r to fp16, times
    svh in fp16. Each fp16 product of two fp16s is exact in float64 before its one rounding, like the GPU's; the
    Hadamards are float64 here and fp32 there, which moves about 1 % of the weights by one fp16 ulp."""
    h = ref.hadamard_128().astype(np.float64) / np.sqrt(128.0)
    w = w_hat64(lin.trellis)
    k, n = w.shape
    w = _f16((h @ w.reshape(k // 128, 128, n)).reshape(k, n))
    w = _f16(w * lin.suh.astype(np.float64)[:, None])
    w = _f16((w.reshape(k, n // 128, 128) @ h).reshape(k, n))
    return _f16(w * lin.svh.astype(np.float64)[None, :])


@pytest.fixture
def rng():
    print(f"seed {SEED}")
    return np.random.default_rng(SEED)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_projection_matches_exllamav3(rng, bits):
    lin = random_linear(rng, HIDDEN, INTER, bits, 1.0)
    exl = exl3_linear(lin)
    w_hat = exl.get_inner_weight_tensor().cpu().numpy()
    assert np.array_equal(w_hat.astype(np.float64), w_hat64(lin.trellis)), "tile layout or codebook differs from exllamav3"

    x = rng.normal(size=(3, HIDDEN)).astype(np.float16).astype(np.float32)  # representable in the GPU's fp16
    y = np.empty((3, INTER), np.float32)
    ce.linear_forward(x, lin, y)
    reference = Reference()
    x64 = x.astype(np.float64)
    err_w_hat = rel_rms(y, reference.rotated(x64, w_hat, lin.suh, lin.svh)).max()
    exact_codebook = w_hat64(lin.trellis, ref.mul1_values)
    err_exact_codebook = rel_rms(y, reference.rotated(x64, exact_codebook, lin.suh, lin.svh)).max()

    dense = exl.get_weight_tensor().cpu().numpy().astype(np.float64)
    emulated = exl3_dense_weight64(lin)
    err_emulation = rel_rms(dense.ravel(), emulated.ravel())
    err_expected = rel_rms(y, x64 @ emulated).max()
    err_dense = rel_rms(y, x64 @ dense).max()

    y_gpu = exl.forward(torch.from_numpy(x).half().cuda(), {}, out_dtype=torch.float).cpu().numpy()
    err_gemm = rel_rms(y, y_gpu).max()
    print(f"K={bits}: vs float64 with exllamav3's W_hat {err_w_hat:.2e} (with the exact codebook {err_exact_codebook:.2e}); "
          f"vs x @ get_weight_tensor() {err_dense:.2e} (emulated {err_expected:.2e}; emulated weight vs "
          f"exllamav3's {err_emulation:.2e}); vs exllamav3's GEMM {err_gemm:.2e}")
    assert err_w_hat < TOLERANCE
    assert err_emulation < 1e-4, "the float64 emulation does not reproduce get_weight_tensor's fp16 roundings"
    assert err_dense < DENSE_BOUND
    assert err_gemm < 1.5e-2


@pytest.mark.parametrize("codebook", ["fp16", "int16"])  # the kernel's own default, and the tier's
@pytest.mark.parametrize("limit", [10.0, 1.0])
def test_expert_matches_exllamav3(rng, limit, codebook):
    from exllamav3.ext import exllamav3_ext as ext

    expert = random_expert(rng, HIDDEN, INTER, 3)
    x = rng.normal(size=(3, HIDDEN)).astype(np.float16)
    w = rng.uniform(0.1, 1.0, 3).astype(np.float32)
    out = np.zeros((3, HIDDEN), np.float32)
    ce.expert_forward(x, *expert, w, out, act_limit=limit, codebook=codebook)

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
    print(f"limit {limit}, {codebook}: kernel vs exllamav3 {err:.2e}; clamping the gate before SiLU instead: {err_gate_first:.2e}")
    assert err < 2e-2
    if limit == 1.0:
        assert err_gate_first > 10 * err, "the clamp order cannot be told apart"
