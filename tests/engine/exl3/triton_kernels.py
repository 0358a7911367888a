"""A real ``triton.autotune`` kernel, for the test that pins one without a GPU (imported only where Triton is)."""

import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (32, 64) for w in (2, 4)]


@triton.autotune(configs=CONFIGS, key=["N"])
@triton.jit
def add_one_kernel(x, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs, mask=offs < N) + 1, mask=offs < N)
