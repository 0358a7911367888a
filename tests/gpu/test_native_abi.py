"""The CUDA library this GPU loads, against the Python mirrors of what it shares with them: ``EcState`` and the
cache's limits (checked by ``Kernels`` at load), ``CtRing``, the CPU tier's outcomes and counters (by ``CtKernels``),
and the expert cache's per-layer counters, which ``offload/cache.py`` indexes by its own ``C_*`` numbers."""

from __future__ import annotations

from glm53.native import abi


def test_the_cuda_librarys_structs_and_numbers_are_the_mirrors():
    from glm53.cpu_tier.device import COUNTERS, CtKernels
    from glm53.offload import cache
    from glm53.offload.ec_native import Kernels

    kernels = Kernels()  # raises AbiMismatch, naming each difference, on a stale library
    ct = CtKernels(kernels.path)
    assert ct.counter_count >= len(COUNTERS) and ct.record_size > 0
    value = abi.lookup(kernels._lib.ec_abi)
    assert [value(f"counter.{n}") for n in ("picks", "hits", "admits", "evicts", "steps", "count")] == \
        [cache.C_PICKS, cache.C_HITS, cache.C_ADMITS, cache.C_EVICTS, cache.C_STEPS, cache.C_N]
