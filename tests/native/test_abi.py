"""The generated bindings applied to the compiled libraries (``glm53.native.abi.bind``): their structs and numbers
are what each library reports about itself (``native/abi.h``), a mirror that is not is refused with every
difference named, and an argument the CUDA library refuses comes back as a sentence naming it. The CUDA library is
built here with nvcc and loaded without a GPU (only the CUDA runtime beside nvcc); tests/gpu/test_native_abi.py
loads it on a GPU."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from glm53.cpu_tier import device, kernel, worker
from glm53.native import abi, cpu, cpu_binding, cuda, cuda_binding, libraries
from glm53.offload import cache_policy, disk, ec_native


def test_the_cpu_librarys_binding_is_its_own_layout():
    lib = cpu.library()  # loading checks every struct and number; the lookups below say what was compared
    ce, ct, dr = abi.lookup(lib.glm53_ce_abi), abi.lookup(lib.glm53_ct_abi), abi.lookup(lib.glm53_dr_abi)
    assert ce("glm53_ce_linear") == ctypes.sizeof(cpu_binding.glm53_ce_linear) == 40
    assert ce("glm53_ce_expert.down") == cpu_binding.glm53_ce_expert.down.offset == 80
    assert ce("GLM53_CE_ISA_AVX512VBMI") == 3 and ce("GLM53_CE_MAX_ROWS") == kernel.MAX_ROWS == 8
    assert ct("glm53_ct_counters") == ctypes.sizeof(cpu_binding.glm53_ct_counters) == 8 * len(worker.COUNTERS)
    assert dr("glm53_dr_request.error_offset") == cpu_binding.glm53_dr_request.error_offset.offset == 40
    assert ce("no.such.name") is None and ce("glm53_ct_pick") is None  # each header's lookup holds its own


def test_the_named_numbers_come_from_the_headers():
    assert kernel.ISAS == ("scalar", "avx2", "avx512", "avx512vbmi") and kernel.CODEBOOKS == ("fp16", "fma", "int16")
    assert worker.STATES == ("empty", "published", "claimed", "done", "failed", "taken_back", "skipped")
    assert worker.COUNTERS[:2] == ("jobs", "done") and worker.COUNTERS[-3:] == ("naps", "payload_rereads", "payload_failed")
    assert disk.STATES == ("pending", "done", "failed")
    assert disk.COUNTERS == ("requests", "failed", "bytes", "disk_bytes", "bounced_bytes", "straight_bytes", "retries", "short_reads",
                             "fallbacks", "pieces")
    assert ec_native.LINK_KINDS == ("misses", "fallback", "admissions", "prefetch", "tier_io", "copies", "probe")
    assert ec_native.PF_COUNTERS == ("copied", "used", "wasted", "plans")
    assert device.OUTCOMES == ("none", "done", "failed", "taken_back_before_claim", "taken_back_after_claim")
    assert device.COUNTERS[4:6] == ("taken_back_before_claim", "taken_back_after_claim") and len(device.COUNTERS) == 10


def test_what_the_two_libraries_and_the_policys_reference_share_is_the_same():
    """The GPU's copy of the ring protocol (expert_cache.h) is cpu_tier.h's, and the NumPy reference of the cache
    policy indexes the kernel's counters by the kernel's numbers."""
    assert {s: getattr(cuda_binding, f"CT_{s.upper()}") for s in worker.STATES} == {s: i for i, s in enumerate(worker.STATES)}
    ring = [name for name, _ in cuda_binding.CtRing._fields_[1:]]
    assert set(ring) <= {name for name, _ in cpu_binding.glm53_ct_layout._fields_}
    assert cuda_binding.CT_ACK == 64  # cpu_tier.h: the worker's line of a slot
    assert (cuda_binding.CT_SUM, cuda_binding.CT_SUM_SEQ) == (cpu_binding.GLM53_CT_SUM, cpu_binding.GLM53_CT_SUM_SEQ)
    assert [cache_policy.C_PICKS, cache_policy.C_HITS, cache_policy.C_ADMITS, cache_policy.C_EVICTS, cache_policy.C_STEPS,
            cache_policy.C_N] == [cuda_binding.C_PICKS, cuda_binding.C_HITS, cuda_binding.C_ADMITS, cuda_binding.C_EVICTS,
                                  cuda_binding.C_STEPS, cuda_binding.C_N]


def test_a_mirror_that_differs_is_refused_naming_each_difference():
    class Shuffled(ctypes.Structure):  # glm53_ce_linear with two fields swapped and one missing
        _fields_ = [("suh", ctypes.c_void_p), ("trellis", ctypes.c_void_p), ("svh", ctypes.c_void_p),
                    ("in_features", ctypes.c_int32), ("out_features", ctypes.c_int32)]

    class Extra(ctypes.Structure):
        _fields_ = [("token", ctypes.c_int32), ("expert", ctypes.c_int32), ("weight", ctypes.c_float), ("spare", ctypes.c_int32)]

    lib = cpu.library()
    found = abi.differences(abi.lookup(lib.glm53_ce_abi), {"glm53_ce_linear": Shuffled},
                            {"GLM53_CE_ISA_AVX2": 2, "GLM53_CE_ISA_SSE2": 9})
    assert found == ["glm53_ce_linear: 40 there, 32 here", "glm53_ce_linear.suh: 8 there, 0 here",
                     "glm53_ce_linear.trellis: 0 there, 8 here", "GLM53_CE_ISA_AVX2: 1 there, 2 here",
                     "GLM53_CE_ISA_SSE2: unknown to the library (here 9)"]
    with pytest.raises(abi.AbiMismatch) as err:
        abi.check(lib.glm53_ct_abi, "libX.so", {"glm53_ct_pick": Extra})
    assert "libX.so does not match this glm53 (rebuild it" in str(err.value)
    assert "glm53_ct_pick: 12 there, 16 here" in str(err.value) and "glm53_ct_pick.spare: unknown to the library" in str(err.value)


def test_a_library_that_lacks_a_declared_function_is_refused_by_name():
    stale = SimpleNamespace(FUNCTIONS={**cpu_binding.FUNCTIONS, "glm53_ce_newer": (None, [])}, ABI={})
    with pytest.raises(abi.AbiMismatch, match=r"libY.so does not match this glm53 .*: it lacks glm53_ce_newer$"):
        abi.bind(ctypes.CDLL(str(cpu.locate())), "libY.so", stale)


def test_names_reads_an_enum_numbered_from_zero():
    group = {"X_BEST": -1, "X_B": 1, "X_A": 0, "X_COUNT": 2}
    assert abi.names(group, "X_", "X_COUNT") == ("a", "b") and abi.names({"X_A": 0, "X_B": 1}, "X_") == ("a", "b")
    with pytest.raises(ValueError, match=r"\['X_A', 'X_C'\] are not X_\* numbered 0, 1, 2"):
        abi.names({"X_A": 0, "X_C": 2}, "X_")


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda lib, ring: lib.glm53_ct_ring_layout(4, 200, 8, 8, ctypes.byref(cpu_binding.glm53_ct_layout())), "glm53_ct_error",
     "ring_layout: hidden is 200, not a positive multiple of 128"),
    (lambda lib, ring: lib.glm53_ct_ring_layout(4, 256, 9, 8, ctypes.byref(cpu_binding.glm53_ct_layout())), "glm53_ct_error",
     "ring_layout: max_tokens is 9, not in 1..8 (GLM53_CE_MAX_ROWS)"),
    (lambda lib, ring: lib.glm53_ct_producer_publish(ring.address, 1, 0, 9, (cpu_binding.glm53_ct_pick * 1)(), 1, 1), "glm53_ct_error",
     "publish: n_tokens is 9, not in 1..8 (the ring's max_tokens)"),
    (lambda lib, ring: lib.glm53_ce_pool_start(None, 0, 0, 0, 1) or -1, "glm53_ce_error", "pool: threads is 0, below 1"),
    (lambda lib, ring: lib.glm53_ce_mul1_values(None, 1, (ctypes.c_float * 1)(), -1, 0), "glm53_ce_error",
     "mul1_values: states is NULL"),
    (lambda lib, ring: lib.glm53_dr_start((ctypes.c_char_p * 1)(b"/dev/null"), 1, 1, 0, 3000, 6000) or -1, "glm53_dr_error",
     "align and piece_bytes are 3000 and 6000: align must be a power of two and piece_bytes a multiple of it"),
])
def test_an_argument_the_cpu_library_refuses_is_named(call, error, message):
    lib = cpu.library()
    assert call(lib, worker.Ring(slots=2, hidden=128)) < 0  # a NULL handle, or a negative code
    assert getattr(lib, error)().decode() == message


def test_a_fault_for_a_file_the_reader_lacks_is_refused_by_name(tmp_path):
    (tmp_path / "shard").write_bytes(bytes(4096))
    with disk.DiskReader([tmp_path / "shard"], threads=1, direct=False) as reader, \
            pytest.raises(ValueError, match=r"^inject: file 5 is not one of the reader's 1 files$"):
        reader.inject(5, 0, None)


@pytest.fixture(scope="module")
def cuda_library(tmp_path_factory):
    """The CUDA library built with nvcc for sm_90 and bound (loading it needs the CUDA runtime, not a GPU)."""
    nvcc = libraries.find_nvcc()
    homes = [Path(nvcc).resolve().parent.parent, *sorted(Path("/usr/local").glob("cuda*"))] if nvcc else []
    runtime = [so for home in homes for so in sorted(home.glob("lib*/libcudart.so*"))]
    if not runtime:
        pytest.skip("no nvcc, or no CUDA runtime beside it")
    ctypes.CDLL(str(runtime[0]), mode=ctypes.RTLD_GLOBAL)  # the library links it by soname
    return cuda.library(libraries.build_ec(nvcc, cuda.SOURCE, tmp_path_factory.mktemp("ec"), ["sm_90"]))[0]


def test_the_cuda_librarys_binding_is_its_own_layout_where_nvcc_is(cuda_library):
    value = abi.lookup(cuda_library.ec_abi)
    assert value("EcState") == ctypes.sizeof(cuda_binding.EcState) == 104 and value("EcState.num_jobs") == 96
    assert value("CtRing.out_offset") == cuda_binding.CtRing.out_offset.offset and value("LE_KINDS") == 7
    assert value("CT_RECORD") == 2 * value("CT_SPLIT_MAX_PICKS") == 128
    assert value("EcRecency") == ctypes.sizeof(cuda_binding.EcRecency) == 40 and value("EcRecency.keep") == 32


@pytest.mark.parametrize(("call", "message"), [
    (lambda lib, s: lib.ec_step(ctypes.byref(s), ctypes.byref(cuda_binding.EcRecency()), 2, None, 0, 0, 0.9, 1.0, 1, 4096, 1, None),
     "ec_step: layer is 2, not in 0..1 (s->num_layers - 1)"),
    (lambda lib, s: lib.ec_step(ctypes.byref(s), ctypes.byref(cuda_binding.EcRecency()), 0, None, 0, 0, 0.9, 1.0, 17, 4096, 1, None),
     "ec_step: max_admit is 17, not in 0..16 (EC_MAX_ADMIT)"),
    (lambda lib, s: lib.ec_step(None, None, 0, None, 0, 0, 0.9, 1.0, 1, 4096, 1, None), "ec_step: s is NULL"),
    (lambda lib, s: lib.ec_prefetch(ctypes.byref(s), ctypes.byref(cuda_binding.EcPool(slots=17)), 0, 8, None, 1, 4, 0.0, 4, 4096, 1, None),
     "ec_prefetch: p->slots is 17, not in 1..16 (PF_MAX_SLOTS)"),
    (lambda lib, s: lib.le_units(ctypes.byref(cuda_binding.LeLink()), None, 0, 0, 0, 7, 1, None),
     "le_units: kind is 7, not in 0..6 (an le_kind)"),
    (lambda lib, s: lib.ct_fallback_plan(None, None, None, 65, 8, 8, None, None, None, None, None),
     "ct_fallback_plan: n is 65, not in 1..64 (CT_SPLIT_MAX_PICKS)"),
])
def test_an_argument_the_cuda_library_refuses_is_named(cuda_library, call, message):
    """Refused before any CUDA call (no GPU needed): cudaErrorInvalidValue, and ec_error() names the argument."""
    state = cuda_binding.EcState(num_layers=2, num_experts=8)
    assert call(cuda_library, state) == 1
    assert cuda_library.ec_error().decode() == message
    with pytest.raises(abi.NativeError, match=f"^{re.escape(message)}$"):
        cuda.checked(cuda_library, 1)


def test_the_cache_kernels_python_calls_reach_the_librarys_checks(cuda_library, monkeypatch):
    """Each ``ec_native.Kernels`` method as the offload calls it, down to the library's own refusal (no GPU: every
    call is refused before a kernel runs), so a wrapper that calls its entry point wrongly fails here, not on a GPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0))
    kernels = ec_native.Kernels(Path(cuda_library._name))
    state, sel = cuda_binding.EcState(num_layers=2, num_experts=8), torch.zeros((1, 4), dtype=torch.int64)
    with pytest.raises(abi.NativeError, match=r"^ec_step: layer is 2, not in 0\.\.1"):
        kernels.step(state, cuda_binding.EcRecency(), 2, sel, 0.9, 1.0, 1, 4096, 1)
    with pytest.raises(abi.NativeError, match=r"^ec_step: rc is NULL"):
        kernels._check(kernels._lib.ec_step(ctypes.byref(state), None, 0, sel.data_ptr(), 4, 4, 0.9, 1.0, 1, 4096, 1, 0))
    with pytest.raises(abi.NativeError, match=r"^ec_prefetch: p->slots is 17"):
        kernels.prefetch(state, cuda_binding.EcPool(slots=17), 0, torch.zeros((1, 4), dtype=torch.int64), 4, 4096, 1)
