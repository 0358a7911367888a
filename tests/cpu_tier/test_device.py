"""glm53.cpu_tier.device on the CPU: the pick packing and the ring struct the kernels read (the handoff itself runs
on the GPU: tests/gpu/test_cpu_tier_device.py)."""

from __future__ import annotations

import ctypes
import re

import torch

from glm53.offload import ec_native
from glm53.cpu_tier.device import COUNTERS, OUTCOMES, pack_picks


def test_picks_pack_as_token_expert_and_the_weights_float_bits():
    packed = pack_picks(torch.tensor([0, 3]), torch.tensor([7, 250]), torch.tensor([0.25, 1e-3], dtype=torch.float16))
    assert packed.dtype == torch.int32 and packed.shape == (2, 3) and packed.is_contiguous()
    assert packed[:, :2].tolist() == [[0, 7], [3, 250]]
    assert packed[:, 2].view(torch.float32).tolist() == [0.25, torch.tensor(1e-3, dtype=torch.float16).item()]


def test_the_ring_struct_and_the_enums_match_the_kernel_source():
    source = ec_native.sources()[1].read_text()
    fields = re.search(r"struct CtRing \{(.*?)\};", source, re.DOTALL).group(1)
    assert "char* base" in fields and "uint32_t slots, hidden, max_tokens, max_picks" in fields
    assert "uint64_t slot_bytes, slots_offset, picks_offset, x_offset, out_offset" in fields
    assert ctypes.sizeof(ec_native.CtRing) == 8 + 4 * 4 + 5 * 8
    outs = re.search(r"enum \{ (CT_OUT_NONE = 0.*?) \};", source).group(1)
    assert [n.split(" = ")[0] for n in outs.split(", ")] == [f"CT_OUT_{o.upper()}".replace("_CLAIM", "") for o in
                                                            ("none", "done", "failed", "taken_back_before_claim", "taken_back_after_claim")]
    assert len(OUTCOMES) == 5
    counters = re.search(r"enum \{ (CT_C_PUBLISHED = 0.*?), CT_N = 16 \};", source, re.DOTALL).group(1)
    names = [n.split("=")[0].strip() for n in counters.split(",")]
    assert names == ["CT_C_" + n for n in ("PUBLISHED", "BUSY", "DONE", "FAILED", "TAKEN_BEFORE", "TAKEN_AFTER", "WAIT_NS",
                                           "FALLBACK_JOBS", "FALLBACK_EXPERTS", "PROBES")]
    assert len(names) == len(COUNTERS) <= 16
