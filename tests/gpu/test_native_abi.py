"""The CUDA library this GPU loads, against its binding (``glm53.native.cuda_binding``, generated from
``native/ec/expert_cache.h``): every struct, number and function checked when ``Kernels`` loads it, the CPU tier's
counters and record, the expert cache's per-layer counters (which ``offload/cache.py`` indexes by the NumPy
reference's own ``C_*`` numbers), and an argument the library refuses raised with its sentence."""

from __future__ import annotations

import pytest

from glm53.native import abi


def test_the_cuda_librarys_structs_and_numbers_are_the_binding():
    from glm53.cpu_tier.device import COUNTERS, CtKernels
    from glm53.native import cuda_binding
    from glm53.offload import cache
    from glm53.offload.ec_native import Kernels

    kernels = Kernels()  # raises AbiMismatch, naming each difference, on a stale library
    ct = CtKernels(kernels.path)
    assert ct.counter_count == cuda_binding.CT_N >= len(COUNTERS) and ct.record_size == 2 * cuda_binding.CT_SPLIT_MAX_PICKS
    value = abi.lookup(kernels._lib.ec_abi)
    assert [value(n) for n in ("C_PICKS", "C_HITS", "C_ADMITS", "C_EVICTS", "C_STEPS", "C_N")] == \
        [cache.C_PICKS, cache.C_HITS, cache.C_ADMITS, cache.C_EVICTS, cache.C_STEPS, cache.C_N]


def test_an_argument_the_cache_step_refuses_is_raised_by_name():
    import torch

    from glm53.offload.ec_native import MAX_ADMIT, EcRecency, EcState, Kernels

    sel = torch.zeros(8, dtype=torch.int64)  # refused before any kernel reads it
    with pytest.raises(abi.NativeError, match=f"^ec_step: max_admit is {MAX_ADMIT + 1}, not in 0..{MAX_ADMIT} \\(EC_MAX_ADMIT\\)$"):
        Kernels().step(EcState(num_layers=2, num_experts=8), EcRecency(), 0, sel, 0.9, 1.0, MAX_ADMIT + 1, 4096, 1)
    with pytest.raises(abi.NativeError, match="^ec_step: layer is 2, not in 0..1"):
        Kernels().step(EcState(num_layers=2, num_experts=8), EcRecency(), 2, sel, 0.9, 1.0, 1, 4096, 1)
