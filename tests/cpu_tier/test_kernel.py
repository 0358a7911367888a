"""The CPU tier's expert kernel (glm53.cpu_tier.kernel) against a float64 NumPy reference.

Every run draws fresh trellis bits, sign/scale vectors, activations and router weights from a seed it prints;
CPU_EXPERT_TEST_SEED=<seed> repeats a run. The reference (exl3_float64) decodes the trellis with
exl3_reference's state extraction and tile permutation and the codebook values exllamav3's GPU kernels use
(exl3_reference.mul1_values_gpu, an fp16 emulation of their fused multiply-add), then does all arithmetic in
float64.
"""

from __future__ import annotations

import os
import shutil
import zlib

import numpy as np
import pytest

from glm53.tools.synth import exl3_reference as ref
from glm53.cpu_tier import kernel as ce

from .exl3_float64 import Reference, random_expert, random_linear, rel_rms, w_hat64

SEED = int(os.environ.get("CPU_EXPERT_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
# Relative RMS error per token of one expert's output (fp32 accumulation) against float64, measured at
# GLM-5.3-Flash's shape (4096 -> 2048 -> 4096, K = 3) over 48 tokens of 6 seeds: 5.0e-7 to 5.9e-7 (median 5.5e-7);
# a single 4096 -> 2048 projection 3.1e-7 to 3.4e-7. (Against the exact codebook instead, a projection is 2e-4 to
# 5e-3 off: the GPU's values sit 1.8e-3 lower, see test_codebook_sits_below_the_exact_one.)
TOLERANCE = 2e-6
GPU_SHIFT = -476 / 2**18  # fp16 0xc931 + 1534 * fp16 0x1eee: how far below the exact codebook the GPU's values sit
LIMIT = 10.0  # GLM-5.3-Flash's swiglu_limit
GLM = (4096, 2048)  # hidden, moe_intermediate (glm53.tools.synth.presets, "full")


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(name.encode())])


@pytest.fixture
def rng(request) -> np.random.Generator:
    print(f"seed {SEED} (CPU_EXPERT_TEST_SEED={SEED} repeats this run)")
    return rng_for(request.node.nodeid)


def skip_unless(isa: str) -> None:
    if isa not in ce.available_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernel (available: {', '.join(ce.available_isas())})")


# ---- the codebook

ALL_STATES = np.arange(1 << 16, dtype=np.uint16)


def test_codebook_emulation_matches_hand_computed_states():
    """exl3_reference.mul1_values_gpu against states worked out by hand from codebook.cuh's constants: the byte
    sum s of state * 0x83DCD12D, N = (1024 + s) * 1774 - 2721792 (fp16 0x1eee = 1774 / 2^18, 0xc931 = -2721792 /
    2^18), the value fp16(N / 2^18): N rounded to 11 significant bits, ties to even."""
    cases = {
        0: 0xC2E8,      # x = 0, s = 0: N = -905216 = -1768 * 2^9, exact: -3.453125
        1: 0x3921,      # x = 0x83DCD12D, s = 0x83 + 0xDC + 0xD1 + 0x2D = 605: N = 168054 = 1312.92 * 2^7 -> 1313 * 2^7,
                        # 0.64111328125
        7129: 0xC12C,   # x = 0x103D0E25, s = 128: N = -678144 = -1324.5 * 2^9, a tie -> -1324 * 2^9 (even), -2.5859375
        448: 0x9770,    # x = 0xC26E0EC0, s = 510: N = -476, exact: -0.0018157958984375 (the exact codebook says 0)
        31579: 0x42B2,  # x = 0xF7FEF9FF, s = 1005 (the largest over 16-bit states): N = 877654 = 1714.17 * 2^9 ->
                        # 1714 * 2^9, 3.34765625
    }
    states = np.array(list(cases), np.uint16)
    got = ref.mul1_values_gpu(states)
    assert got.dtype == np.float16
    assert [hex(v) for v in got.view(np.uint16)] == [hex(v) for v in cases.values()]


@pytest.mark.parametrize("isa", ce.ISAS)
def test_codebook_is_the_gpu_fp16_value_for_every_state(isa):
    skip_unless(isa)
    got = ce.mul1_values(ALL_STATES, isa=isa)
    want = ref.mul1_values_gpu(ALL_STATES).astype(np.float32)
    bad = np.flatnonzero(got != want)
    assert not len(bad), f"{isa}: {len(bad)} states differ, e.g. state {bad[0]}: {got[bad[0]]!r} != {want[bad[0]]!r}"


def test_codebook_sits_below_the_exact_one():
    """The kernel's values are the exact codebook (byte sum - 510) * fp16 0x1eee shifted by -476 / 2^18 and rounded
    to fp16: a regression to the exact codebook (or a rounding that is not fp16's) fails here."""
    got = ce.mul1_values(ALL_STATES).astype(np.float64)
    exact = ref.mul1_values(ALL_STATES).astype(np.float64)  # exact in float32: an 11-bit times a 10-bit integer
    shifted = exact + GPU_SHIFT
    half_ulp = np.spacing(np.abs(got).astype(np.float16)).astype(np.float64) / 2
    assert (np.abs(got - shifted) <= half_ulp).all()  # the shift, then one rounding to fp16
    assert (got < exact).all()  # the shift (1.8e-3) exceeds any rounding (at most 2^-10)
    assert abs(np.mean(got - exact) - GPU_SHIFT) < 1e-5
    assert np.sqrt(np.mean((got - shifted) ** 2)) > 1e-5  # and the rounding is there


@pytest.mark.parametrize("isa", ce.ISAS)
def test_fma_codebook_is_the_gpus_multiply_add_before_its_rounding(isa):
    """The ``fma`` codebook: the GPU's fused multiply-add exactly, unrounded; at most half an fp16 ulp from the
    fp16 weights, 2.1e-4 relative RMS over the states, without bias."""
    skip_unless(isa)
    got = ce.mul1_values(ALL_STATES, isa=isa, codebook="fma").astype(np.float64)
    want = ref.mul1_values_gpu_unrounded(ALL_STATES)
    assert np.array_equal(got, want), f"{isa}: {np.count_nonzero(got != want)} states differ"
    gpu = ref.mul1_values_gpu(ALL_STATES)
    half_ulp = np.spacing(np.abs(gpu)).astype(np.float64) / 2
    assert (np.abs(got - gpu) <= half_ulp).all()
    rms = np.sqrt(np.mean(gpu.astype(np.float64) ** 2))
    assert 1.9e-4 < np.sqrt(np.mean((got - gpu) ** 2)) / rms < 2.3e-4
    assert abs(np.mean(got - gpu)) / rms < 1e-5


@pytest.mark.parametrize("isa", ce.ISAS)
def test_int16_weights_are_the_fma_ones(isa):
    """``int16`` rounds the inputs, not the weights: its codebook values are ``fma``'s."""
    skip_unless(isa)
    got = ce.mul1_values(ALL_STATES, isa=isa, codebook="int16").astype(np.float64)
    assert np.array_equal(got, ref.mul1_values_gpu_unrounded(ALL_STATES))


def test_an_unknown_codebook_is_refused_by_name():
    with pytest.raises(ValueError, match="codebook must be one of fp16, fma, int16, got 'bf16'"):
        ce.mul1_values(ALL_STATES[:16], codebook="bf16")


# ---- one projection


@pytest.mark.parametrize("n_in, n_out, bits, rows", [
    (*GLM, 3, 3), (256, 384, 2, 1), (384, 256, 4, 8), (128, 128, 1, 2), (256, 128, 5, 11), (128, 256, 8, 4)])
def test_linear_matches_float64_on_every_isa(rng, n_in, n_out, bits, rows):
    lin = random_linear(rng, n_in, n_out, bits, 1.0)
    x = rng.normal(size=(rows, n_in)).astype(np.float32)
    want = Reference().linear(x.astype(np.float64), lin)
    results = {}
    for isa in ce.available_isas():
        y = np.full((rows, n_out), np.nan, np.float32)  # every element must be written
        ce.linear_forward(x, lin, y, isa=isa)
        assert np.isfinite(y).all(), isa
        err = rel_rms(y, want).max()
        assert err < TOLERANCE, f"{isa}: relative RMS {err:.3g} (seed {SEED})"
        results[isa] = y
    for isa, y in results.items():
        assert np.array_equal(y, results["scalar"]), f"{isa} differs from scalar (seed {SEED})"


# INT16 (native/cpu_expert/format.h): fma's weights against the input rounded to 16 bits per 128-block. With normal
# inputs one projection is 2.3e-5 to 3.2e-5 relative RMS from the float64 fma result (6 shapes, K = 1..8), where
# fma itself is 1.5e-7 to 3.3e-7 off.
INT16_TOLERANCE = 1e-4
LINEAR_CASES = [(*GLM, 3, 3), (256, 384, 2, 1), (384, 256, 4, 8), (128, 128, 1, 2), (256, 128, 5, 11), (128, 256, 8, 4)]


def int16_results(x, lin) -> dict[str, np.ndarray]:
    results = {}
    for isa in ce.available_isas():
        y = np.full((x.shape[0], lin.svh.shape[0]), np.nan, np.float32)
        ce.linear_forward(x, lin, y, isa=isa, codebook="int16")
        results[isa] = y
    return results


@pytest.mark.parametrize("n_in, n_out, bits, rows", LINEAR_CASES)
def test_int16_linear_matches_float64_on_every_isa(rng, n_in, n_out, bits, rows):
    lin = random_linear(rng, n_in, n_out, bits, 1.0)
    x = rng.normal(size=(rows, n_in)).astype(np.float32)
    want = Reference(ref.mul1_values_gpu_unrounded).linear(x.astype(np.float64), lin)
    results = int16_results(x, lin)
    for isa, y in results.items():
        assert np.isfinite(y).all(), isa
        err = rel_rms(y, want).max()
        assert err < INT16_TOLERANCE, f"{isa}: relative RMS {err:.3g} (seed {SEED})"
        assert np.array_equal(y, results["scalar"]), f"{isa} differs from scalar (seed {SEED})"
    fma = np.zeros_like(results["scalar"])
    ce.linear_forward(x, lin, fma, codebook="fma")
    assert rel_rms(results["scalar"], want).max() > 10 * rel_rms(fma, want).max(), "int16 did not round its inputs"


@pytest.mark.parametrize("bits", [3, 6])
def test_int16_is_exact_where_the_rounding_is(rng, bits):
    """An input that rotates to one magnitude in its block rounds to +-32767 exactly: there the integer sums, the
    block's scale and the -476 offset must give the float64 fma result to fp32 accuracy (a slip in any of them
    would be orders of magnitude off). The other blocks are all zero, which must add nothing."""
    lin = random_linear(rng, 384, 256, bits, 1.0)
    x = np.zeros((3, 384), np.float32)
    x[0, 0], x[1, 130], x[2, 300] = 1.5, -0.25, 40.0
    want = Reference(ref.mul1_values_gpu_unrounded).linear(x.astype(np.float64), lin)
    for isa, y in int16_results(x, lin).items():
        err = rel_rms(y, want).max()
        assert err < TOLERANCE, f"{isa}: relative RMS {err:.3g} (seed {SEED})"


def test_int16_blocks_of_zeros_and_of_tiny_values_add_nothing(rng):
    """A block whose largest value is below 1e-30 (whose 1 / max would overflow) rounds to zero, as a zero block."""
    lin = random_linear(rng, 256, 128, 3, 1.0)
    x = rng.normal(size=(3, 256)).astype(np.float32)
    x[0] = 0.0
    x[1] = 1e-38 * np.sign(x[1])  # rotates to subnormals
    results = int16_results(x, lin)
    for isa, y in results.items():
        assert np.array_equal(y[:2], np.zeros((2, 128), np.float32)), isa
        assert np.isfinite(y[2]).all() and np.abs(y[2]).max() > 0, isa


def test_int16_a_non_finite_input_spoils_only_its_row(rng):
    lin = random_linear(rng, 256, 128, 3, 1.0)
    x = rng.normal(size=(3, 256)).astype(np.float32)
    x[1, 7] = np.inf
    for isa, y in int16_results(x, lin).items():
        assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all(), isa


def test_decoder_matches_exl3_reference_dense_weight(rng):
    """The float64 reference and exl3_reference.dense_weight (exact codebook) describe the same linear."""
    lin = random_linear(rng, 256, 384, 3, 1.0)
    x = rng.normal(size=(2, 256))
    dense = ref.dense_weight(lin.trellis, lin.suh, lin.svh).astype(np.float64)
    exact = Reference().rotated(x, w_hat64(lin.trellis, ref.mul1_values), lin.suh, lin.svh)
    assert rel_rms(exact, x @ dense).max() < 1e-6


# ---- whole experts


@pytest.fixture(scope="module")
def glm_expert():
    """One expert at GLM-5.3-Flash's real shape, K = 3, with its float64 results and the scalar kernel's."""
    rng = rng_for("glm_expert")
    expert = random_expert(rng, *GLM, 3)
    reference = Reference()
    cases = {}
    for rows in (1, 3, 8):
        x = rng.normal(size=(rows, GLM[0])).astype(np.float16)
        w = rng.uniform(0.05, 1.0, rows).astype(np.float32)
        out0 = 0.01 * rng.normal(size=(rows, GLM[0])).astype(np.float32)  # an overwrite would be 7% off
        want, g, u = reference.expert(x, expert, LIMIT)
        scalar = out0.copy()
        ce.expert_forward(x, *expert, w, scalar, act_limit=LIMIT, isa="scalar")
        cases[rows] = (x, w, out0, want, g, u, scalar)
    return expert, cases


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("isa", ce.ISAS)
def test_glm_expert_matches_float64(glm_expert, isa, rows):
    skip_unless(isa)
    expert, cases = glm_expert
    x, w, out0, want, g, u, scalar = cases[rows]
    assert np.mean(g > LIMIT) > 0.01 and np.mean(np.abs(u) > LIMIT) > 0.02, "the clamp is not engaged"
    out = out0.copy()
    ce.expert_forward(x, *expert, w, out, act_limit=LIMIT, isa=isa)
    err = rel_rms(out.astype(np.float64) - out0, w[:, None] * want).max()
    assert err < TOLERANCE, f"{isa}: relative RMS {err:.3g} (seed {SEED})"
    assert np.array_equal(out, scalar), f"{isa} differs from scalar (seed {SEED})"


@pytest.mark.parametrize("rows", [1, 8])
def test_glm_expert_with_the_fma_codebook(glm_expert, rows):
    """Against float64 with the unrounded codebook: the kernel's own arithmetic error, as with fp16; every ISA
    alike bit for bit. Against the fp16 weights' float64 result the expert moves by the codebook's rounding:
    relative RMS 3.5e-4 to 4.2e-4 per token (measured over 9 tokens of 5 seeds), inside the 1e-3 of
    exllamav3's own kernels."""
    expert, cases = glm_expert
    x, w, out0, want_fp16, _, _, _ = cases[rows]
    want = Reference(ref.mul1_values_gpu_unrounded).expert(x, expert, LIMIT)[0]
    results = {}
    for isa in ce.available_isas():
        out = out0.copy()
        ce.expert_forward(x, *expert, w, out, act_limit=LIMIT, isa=isa, codebook="fma")
        got = out.astype(np.float64) - out0
        err = rel_rms(got, w[:, None] * want).max()
        assert err < TOLERANCE, f"{isa}: relative RMS {err:.3g} (seed {SEED})"
        results[isa] = out
    assert all(np.array_equal(r, results["scalar"]) for r in results.values()), f"ISAs differ (seed {SEED})"
    moved = rel_rms(got, w[:, None] * want_fp16)
    print(f"fma codebook against the fp16 weights: relative RMS {moved.min():.3g} to {moved.max():.3g}")
    assert 5e-5 < moved.max() < 8e-4, f"{moved} (seed {SEED})"


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_glm_expert_with_the_int16_codebook(glm_expert, rows):
    """The tier's default: against float64 with fma's weights, the inputs' rounding (4.0e-5 to 4.9e-5 relative RMS
    per token at GLM's shape, 5 seeds); every ISA alike bit for bit."""
    expert, cases = glm_expert
    x, w, out0, _, _, _, _ = cases[rows]
    want = Reference(ref.mul1_values_gpu_unrounded).expert(x, expert, LIMIT)[0]
    results = {}
    for isa in ce.available_isas():
        out = out0.copy()
        ce.expert_forward(x, *expert, w, out, act_limit=LIMIT, isa=isa, codebook="int16")
        err = rel_rms(out.astype(np.float64) - out0, w[:, None] * want)
        assert err.max() < INT16_TOLERANCE, f"{isa}: relative RMS {err.max():.3g} (seed {SEED})"
        results[isa] = out
    print(f"int16 against float64 with fma's weights: relative RMS {err.min():.3g} to {err.max():.3g}")
    assert all(np.array_equal(r, results["scalar"]) for r in results.values()), f"ISAs differ (seed {SEED})"


@pytest.mark.parametrize("bits", [2, 4])
def test_expert_other_bit_widths(rng, bits):
    expert = random_expert(rng, 512, 384, bits)
    x = rng.normal(size=(3, 512)).astype(np.float16)
    w = rng.uniform(0.05, 1.0, 3).astype(np.float32)
    want, _, u = Reference().expert(x, expert, LIMIT)
    assert np.mean(np.abs(u) > LIMIT) > 0.02
    results = []
    for isa in ce.available_isas():
        out = np.zeros((3, 512), np.float32)
        ce.expert_forward(x, *expert, w, out, act_limit=LIMIT, isa=isa)
        assert rel_rms(out, w[:, None] * want).max() < TOLERANCE, f"{isa} (seed {SEED})"
        results.append(out)
    assert all(np.array_equal(r, results[0]) for r in results)


def test_no_limit_and_fp32_input(rng):
    expert = random_expert(rng, 256, 256, 3)
    x = rng.normal(size=(2, 256)).astype(np.float32)
    want, _, u = Reference().expert(x, expert, 0.0)
    assert np.abs(u).max() > LIMIT  # a clamp would show
    out = np.zeros((2, 256), np.float32)
    ce.expert_forward(x, *expert, np.ones(2, np.float32), out, act_limit=0.0)
    assert rel_rms(out, want).max() < TOLERANCE, f"seed {SEED}"


def test_several_experts_accumulate_in_order(rng):
    """out += each routed expert's weighted output; zero weights skip; unrouted rows are not touched."""
    experts = [random_expert(rng, 256, 384, 3) for _ in range(3)]
    x = rng.normal(size=(4, 256)).astype(np.float16)
    weights = rng.uniform(0.05, 1.0, (3, 4)).astype(np.float32)
    weights[1, 0] = 0.0
    weights[:, 2] = 0.0  # token 2 goes to none of them
    out0 = 0.01 * rng.normal(size=(4, 256)).astype(np.float32)
    out0[2] = np.nan
    out = out0.copy()
    ce.experts_forward(x, experts, weights, out, act_limit=LIMIT)
    assert np.isnan(out[2]).all()

    reference = Reference()
    want = sum(weights[e][:, None] * reference.expert(x, experts[e], LIMIT)[0] for e in range(3))
    routed = [0, 1, 3]
    assert rel_rms(out[routed] - out0[routed].astype(np.float64), want[routed]).max() < TOLERANCE, f"seed {SEED}"

    one_by_one = out0.copy()
    for e in range(3):
        ce.experts_forward(x, [experts[e]], weights[e:e + 1], one_by_one, act_limit=LIMIT)
    assert np.array_equal(out, one_by_one, equal_nan=True)


def test_an_expert_table_is_the_same_call_laid_out_once(rng):
    """ExpertTable (what timing loops pass, so that they time the kernel and not Python's marshalling) gives the
    list's result bit for bit and is checked like it."""
    experts = [random_expert(rng, 256, 384, 3) for _ in range(2)]
    x = rng.normal(size=(2, 256)).astype(np.float16)
    weights = rng.uniform(0.05, 1.0, (2, 2)).astype(np.float32)
    from_list, from_table = np.zeros((2, 256), np.float32), np.zeros((2, 256), np.float32)
    ce.experts_forward(x, experts, weights, from_list, act_limit=LIMIT, codebook="int16")
    table = ce.ExpertTable(experts)
    ce.experts_forward(x, table, weights, from_table, act_limit=LIMIT, codebook="int16")
    assert len(table) == 2 and np.array_equal(from_list, from_table) and np.abs(from_table).max() > 0
    with pytest.raises(ValueError, match=r"weights must have shape \(2, 2\)"):
        ce.experts_forward(x, table, weights[:1], from_table, act_limit=LIMIT)
    bad = (experts[0][0], ce.Linear(experts[0][1].trellis, experts[0][1].suh.astype(np.float32), experts[0][1].svh), experts[0][2])
    with pytest.raises(ValueError, match=r"experts\[0\].up.suh must be float16"):
        ce.ExpertTable([bad])


# ---- the thread pool


def _spans_per_block(blocks: int, threads: int, units: int) -> int:
    """expert.cpp's spans_per_block: the 16-column tiles of a projection unit are 8 / this."""
    spans = 1
    while spans < 8 and blocks * spans < units * threads:
        spans *= 2
    return spans


@pytest.mark.parametrize("codebook", ["fp16", "int16"])
@pytest.mark.parametrize("isa", ce.available_isas())
@pytest.mark.parametrize("n_experts,rows", [(1, 1), (2, 3), (1, 4)])  # AVX-512 pairs tiles up to 3 rows, not from 4
def test_pool_results_do_not_depend_on_threads(rng, codebook, isa, n_experts, rows):
    """Every thread count and unit size gives the single thread's bits, on every ISA: down to one 16-column tile a
    unit, where a kernel that computes tiles in pairs must not pair a span's last tile with the next span's first
    (a race on that span's columns between two threads: wrong results only with a pool)."""
    hidden, inter = 1024, 512
    experts = [random_expert(rng, hidden, inter, 3) for _ in range(n_experts)]
    x = rng.normal(size=(rows, hidden)).astype(np.float16)
    weights = rng.uniform(0.05, 1.0, (n_experts, rows)).astype(np.float32)
    alone = np.zeros((rows, hidden), np.float32)
    ce.experts_forward(x, experts, weights, alone, act_limit=LIMIT, codebook=codebook, isa=isa)
    cpus = sorted(os.sched_getaffinity(0))
    # spin_us=0: workers and caller sleep on the futex between every phase, the path an idle tier takes; from
    # 5 threads on the projections run in half (and from 9 in quarter) blocks, which must change nothing either;
    # units_per_thread 16: down to single 16-column tiles
    cases = ((1, 100, 4), (2, 100, 4), (3, 0, 4), (5, 50, 4), (9, 50, 4), (3, 50, 16), (9, 50, 16), (9, 50, 1))
    blocks = min(2 * n_experts * inter // 128, n_experts * hidden // 128)
    spans = {_spans_per_block(blocks, threads + 1, units) for threads, _, units in cases}
    assert 8 in spans and 1 in spans  # one-tile units and whole blocks are both among the cases
    for threads, spin_us, units in cases:
        with ce.Pool(cpus, threads, spin_us=spin_us, units_per_thread=units) as pool:
            for _ in range(8):
                out = np.zeros((rows, hidden), np.float32)
                ce.experts_forward(x, experts, weights, out, act_limit=LIMIT, pool=pool, codebook=codebook, isa=isa)
                assert np.array_equal(out, alone), f"{threads} threads, spin {spin_us} us, {units} units a thread"


def test_pool_refuses_a_cpu_it_cannot_use():
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ce.KernelError, match=f"CPU {beyond}"):
        ce.Pool([beyond]).start()
    with pytest.raises(ce.KernelError, match="no CPU 100000"):
        ce.Pool([100000]).start()


def test_pool_for_caller_from_settings():
    from glm53 import config

    # one CPU: the caller and the pool share it; 2 threads in all, the caller one of them
    settings = config.load([], {"GLM53_CT_CPUS": "0", "GLM53_CT_THREADS": "2"})
    pool, caller_cpu = ce.Pool.for_caller(settings)
    assert (pool.cpus, pool.threads, caller_cpu) == ((0,), 1, None)
    with pool:
        assert ce.library().glm53_ce_pool_threads(pool.handle) == 1
    # several: the caller gets the first, the pool one thread on each of the others (not started here)
    pool, caller_cpu = ce.Pool.for_caller(config.load([], {"GLM53_CT_CPUS": "3-5"}), spin_us=2000)
    assert (pool.cpus, pool.threads, pool.spin_us, caller_cpu) == ((4, 5), 2, 2000, 3)


def test_tier_cpus_auto_takes_one_cpu_per_core_and_leaves_the_first(tmp_path):
    topology = {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0), 5: (1, 0)}  # cpu: (package, core)
    for cpu, (package, core) in topology.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")
    assert ce.tier_cpus("auto", allowed=range(6), sys_cpu=tmp_path) == (1, 4)
    assert ce.tier_cpus("auto", allowed=[2], sys_cpu=tmp_path) == (2,)
    assert ce.tier_cpus((3, 5), sys_cpu=tmp_path) == (3, 5)


# ---- arguments


def test_bad_arguments_name_what_is_wrong(rng):
    gate, up, down = random_expert(rng, 256, 128, 3)
    x = np.zeros((2, 256), np.float16)
    w, out = np.ones(2, np.float32), np.zeros((2, 256), np.float32)
    cases = [
        ({"x": x.astype(np.int32)}, "x must be float16 or float32"),
        ({"x": np.zeros((9, 256), np.float16), "out": np.zeros((9, 256), np.float32), "w": np.ones(9, np.float32)}, "T in 1..8"),
        ({"out": np.zeros((2, 256), np.float64)}, "out must be float32"),
        ({"out": np.zeros((2, 128), np.float32)}, r"out must have shape \(2, 256\)"),
        ({"out": np.zeros((2, 512), np.float32)[:, ::2]}, "out must be C-contiguous"),
        ({"gate": ce.Linear(gate.trellis, gate.suh.astype(np.float32), gate.svh)}, r"experts\[0\].gate.suh must be float16"),
        ({"up": ce.Linear(up.trellis[:, :, :40].copy(), up.suh, up.svh)}, r"experts\[0\].up.trellis must be \[in/16, out/16, 16 K\]"),
    ]
    for change, message in cases:
        args = {"x": x, "gate": gate, "up": up, "down": down, "w": w, "out": out} | change
        with pytest.raises(ValueError, match=message):
            ce.expert_forward(args["x"], args["gate"], args["up"], args["down"], args["w"], args["out"], act_limit=LIMIT)
    with pytest.raises(ValueError, match="isa must be one of"):
        ce.expert_forward(x, gate, up, down, w, out, act_limit=LIMIT, isa="avx9")
    narrow = random_linear(rng, 256, 256, 3, 1.0)
    with pytest.raises(ce.KernelError, match="gate and up must be 256 -> 128"):
        ce.expert_forward(x, gate, narrow, down, w, out, act_limit=LIMIT)
    with pytest.raises(ce.KernelError, match="act_limit"):
        ce.expert_forward(x, gate, up, down, w, out, act_limit=-1.0)


def test_build_without_a_compiler_says_what_to_install(tmp_path, monkeypatch):
    native = tmp_path / "native"
    shutil.copytree(ce.NATIVE, native, ignore=shutil.ignore_patterns("build"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").symlink_to(shutil.which("make"))
    monkeypatch.setattr(ce, "NATIVE", native)
    monkeypatch.setattr(ce, "LIBRARY", native / "build" / ce.LIBRARY.name)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ce.NativeBuildError, match="a C\\+\\+ compiler is needed; Debian: apt-get install g\\+\\+ make"):
        ce.build()
