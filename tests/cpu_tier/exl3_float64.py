"""A float64 reference for EXL3 (mul1) linears and experts, and random ones to feed it, shared by the CPU tier's
kernel tests and their GPU comparison with exllamav3."""

from __future__ import annotations

import numpy as np

from glm53.tools.synth import exl3_reference as ref
from glm53.cpu_tier import kernel as ce


def random_linear(rng, n_in: int, n_out: int, bits: int, rms_out: float) -> ce.Linear:
    """Random bits decode to codebook values of RMS ~1; svh sets the output RMS for unit-RMS inputs."""
    trellis = rng.integers(0, 1 << 16, size=(n_in // 16, n_out // 16, 16 * bits), dtype=np.uint16).view(np.int16)
    suh = rng.choice([-1.0, 1.0], n_in) * rng.uniform(0.5, 1.5, n_in)
    svh = rng.choice([-1.0, 1.0], n_out) * rng.uniform(0.5, 1.5, n_out) * rms_out / (1.08 * np.sqrt(n_in))
    return ce.Linear(trellis, suh.astype(np.float16), svh.astype(np.float16))


def random_expert(rng, hidden: int, inter: int, bits: int) -> tuple[ce.Linear, ce.Linear, ce.Linear]:
    """Gate and up outputs of RMS 6, so that the clamp at 10 bites on a few percent of them."""
    return (random_linear(rng, hidden, inter, bits, 6.0), random_linear(rng, hidden, inter, bits, 6.0),
            random_linear(rng, inter, hidden, bits, 1.0 / 8))


def w_hat64(trellis: np.ndarray, values=ref.mul1_values_gpu) -> np.ndarray:
    """The codebook weights [in, out] in float64. values maps states to codebook values: by default the fp16 value
    exllamav3's GPU kernels decode (exl3_reference.mul1_values_gpu, an fp16 emulation of their fused multiply-add,
    which the kernel must reproduce bit for bit); exl3_reference.mul1_values for the exact codebook."""
    vals = values(ref.decode_states(trellis)).astype(np.float64)
    tiles = np.empty_like(vals)
    tiles[..., ref.tc_perm()] = vals
    k, n = trellis.shape[:2]
    return tiles.reshape(k, n, 16, 16).transpose(0, 2, 1, 3).reshape(k * 16, n * 16)


class Reference:
    """float64 projections with a codebook (by default the GPU's fp16 values; see w_hat64), the decoded weights kept
    per linear."""

    def __init__(self, values=ref.mul1_values_gpu) -> None:
        self.values = values
        self._w: dict[int, np.ndarray] = {}
        self._h = ref.hadamard_128().astype(np.float64) / np.sqrt(128.0)

    def linear(self, x: np.ndarray, lin: ce.Linear) -> np.ndarray:
        if id(lin.trellis) not in self._w:
            self._w[id(lin.trellis)] = w_hat64(lin.trellis, self.values)
        return self.rotated(x, self._w[id(lin.trellis)], lin.suh, lin.svh)

    def rotated(self, x: np.ndarray, w_hat: np.ndarray, suh: np.ndarray, svh: np.ndarray) -> np.ndarray:
        """x @ diag(suh) H w_hat H diag(svh) (H orthonormal per 128-block), all in float64."""
        rows = len(x)
        xr = ((x * suh.astype(np.float64)).reshape(rows, -1, 128) @ self._h).reshape(rows, -1)
        y = ((xr @ w_hat.astype(np.float64)).reshape(rows, -1, 128) @ self._h).reshape(rows, -1)
        return y * svh.astype(np.float64)

    def expert(self, x: np.ndarray, expert, limit: float, clamp_gate_first: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The expert's output and its gate and up outputs. The clamp is exllamav3's, min(silu(g), limit); with
        clamp_gate_first it is silu(min(g, limit)) instead (the order of glm53.engine.tiny.model.swiglu)."""
        gate, up, down = expert
        x = x.astype(np.float64)
        g, u = self.linear(x, gate), self.linear(x, up)
        g_in = np.minimum(g, limit) if limit and clamp_gate_first else g
        with np.errstate(over="ignore"):
            a = g_in / (1.0 + np.exp(-g_in))
        if limit:
            a, u_c = np.minimum(a, limit), np.clip(u, -limit, limit)
        else:
            u_c = u
        return self.linear(a * u_c, down), g, u


def rel_rms(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per row."""
    return np.sqrt(np.mean((got - want) ** 2, axis=-1) / np.mean(want ** 2, axis=-1))
