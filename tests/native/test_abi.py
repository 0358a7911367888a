"""The ctypes mirrors of the native structs and the shared numbers, checked against what the compiled CPU library
reports about itself (``native/abi.h``, ``glm53.native.abi``): they match, and a mirror that does not is refused with
every difference named. The CUDA library's mirrors are checked the same way where it loads (tests/gpu/test_native_abi.py,
and tests/native/test_libraries.py where nvcc is)."""

from __future__ import annotations

import ctypes

import pytest

from glm53.cpu_tier import kernel, worker
from glm53.native import abi


def test_the_cpu_librarys_mirrors_are_its_own_layout():
    lib = worker.library()  # loading checks them; the lookups below say what was compared
    ce, ct = abi.lookup(lib.glm53_ce_abi), abi.lookup(lib.glm53_ct_abi)
    assert ce("glm53_ce_linear") == ctypes.sizeof(kernel._CLinear) and ce("glm53_ce_expert.down") == kernel._CExpert.down.offset
    assert [ce(f"isa.{name}") for name in kernel.ISAS] == list(range(len(kernel.ISAS))) and ce("limit.max_rows") == kernel.MAX_ROWS
    assert ct("glm53_ct_counters") == ctypes.sizeof(worker._CCounters) and ct("state.skipped") == worker.STATES.index("skipped")
    assert ce("no.such.name") is None


def test_a_mirror_that_differs_is_refused_naming_each_difference():
    class Shuffled(ctypes.Structure):  # glm53_ce_linear with two fields swapped and one missing
        _fields_ = [("suh", ctypes.c_void_p), ("trellis", ctypes.c_void_p), ("svh", ctypes.c_void_p),
                    ("in_features", ctypes.c_int32), ("out_features", ctypes.c_int32)]

    class Extra(ctypes.Structure):
        _fields_ = [("token", ctypes.c_int32), ("expert", ctypes.c_int32), ("weight", ctypes.c_float), ("spare", ctypes.c_int32)]

    lib = worker.library()
    found = abi.differences(abi.lookup(lib.glm53_ce_abi), {"glm53_ce_linear": Shuffled}, {"isa.avx2": 2, "isa.sse2": 9})
    assert found == ["glm53_ce_linear: 40 there, 32 here", "glm53_ce_linear.suh: 8 there, 0 here",
                     "glm53_ce_linear.trellis: 0 there, 8 here", "isa.avx2: 1 there, 2 here", "isa.sse2: unknown to the library (here 9)"]
    with pytest.raises(abi.AbiMismatch) as err:
        abi.check(lib.glm53_ct_abi, "libX.so", {"glm53_ct_pick": Extra})
    assert "libX.so does not match this glm53 (rebuild it" in str(err.value)
    assert "glm53_ct_pick: 12 there, 16 here" in str(err.value) and "glm53_ct_pick.spare: unknown to the library" in str(err.value)


def test_the_cuda_librarys_mirrors_are_its_own_layout_where_nvcc_is(tmp_path):
    """Built here with nvcc (no GPU needed to load it, only the CUDA runtime beside nvcc): the expert cache's and the
    prefetch pool's structs and numbers are ``ec_native``'s mirrors."""
    from pathlib import Path

    from glm53.native import cuda, libraries
    from glm53.offload import ec_native

    nvcc = libraries.find_nvcc()
    homes = [Path(nvcc).resolve().parent.parent, *sorted(Path("/usr/local").glob("cuda*"))] if nvcc else []
    runtime = [so for home in homes for so in sorted(home.glob("lib*/libcudart.so*"))]
    if not runtime:
        pytest.skip("no nvcc, or no CUDA runtime beside it")
    ctypes.CDLL(str(runtime[0]), mode=ctypes.RTLD_GLOBAL)  # the library links it by soname
    lib = ctypes.CDLL(str(libraries.build_ec(nvcc, cuda.SOURCE, tmp_path, ["sm_90"])))
    abi.check(lib.ec_abi, "ec", {"EcState": ec_native.EcState, "EcRecency": ec_native.EcRecency},
              {"limit.max_admit": ec_native.MAX_ADMIT, "limit.max_experts": ec_native.MAX_EXPERTS})
    value = abi.check(lib.ec_prefetch_abi, "ec", {"EcPool": ec_native.EcPool},
                      {"limit.max_slots": ec_native.PF_MAX_SLOTS, "limit.max_predicted": ec_native.PF_MAX_PREDICTED})
    assert [value(f"counter.{n}") for n in ec_native.PF_COUNTERS] == list(range(len(ec_native.PF_COUNTERS)))
    assert value("counter.count") == len(ec_native.PF_COUNTERS)
