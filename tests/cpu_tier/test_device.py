"""glm53.cpu_tier.device on the CPU: the pick packing (the handoff itself runs on the GPU:
tests/gpu/test_cpu_tier_device.py; the ring struct and the numbers are checked against the CUDA library where it
loads: tests/gpu/test_native_abi.py, and tests/native/test_libraries.py where nvcc is)."""

from __future__ import annotations

import torch

from glm53.cpu_tier.device import pack_picks


def test_picks_pack_as_token_expert_and_the_weights_float_bits():
    packed = pack_picks(torch.tensor([0, 3]), torch.tensor([7, 250]), torch.tensor([0.25, 1e-3], dtype=torch.float16))
    assert packed.dtype == torch.int32 and packed.shape == (2, 3) and packed.is_contiguous()
    assert packed[:, :2].tolist() == [[0, 7], [3, 250]]
    assert packed[:, 2].view(torch.float32).tolist() == [0.25, torch.tensor(1e-3, dtype=torch.float16).item()]
