"""The expert cache's CUDA kernel (``ec_step_kernel``, native/ec/expert_cache.cu) against the policy's reference
(glm53.offload.cache_policy): the same routing traces drive an ``ExpertCache`` and a ``ReferenceCache``, and after
every layer's step the two hold the same slow and fast scores and reuse lifts (bit for bit), previous first-row
picks, slots, slot owners, copy jobs (the admissions with their slots), per-expert picks and counters (picks, hits,
admissions, evictions). The traces: tests/offload/test_cache_policy.py's random ones of 1-4 rows a step (picks
independent of the past: the recency weight stays small), and the ``trained`` routing twin's (one row a step, picks
recurring over tokens: the weight grows and the fast score decides admissions). No model: the cache runs over a stand-in for the host store holding random
bytes, so the test also sees every admitted expert's bytes reach its slot and the pointer tables follow
(``ExpertCache.verify``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.routing_stats import twin_from_settings
from glm53.offload.cache import ExpertCache, Policy
from glm53.offload.cache_policy import C_ADMITS, ReferenceCache
from glm53.offload.host_store import ExpertLayout
from tests.offload.test_cache_policy import SLOTS, picks_profile, popularity, routing_trace

POLICIES = {
    "default": Policy(),  # the two-timescale score
    "slow-only": Policy(decay=0.995, max_admit=2, recency_weight=0.0),  # the first cache's policy
    "ties": Policy(decay=1.0, hysteresis=1.0, max_admit=4, recency_weight=0.0),  # integer steps on equal scores: ties decide
    # the kernel's most admissions per step, and a fast score that moves more than the slow one
    "eager": Policy(decay=0.9, hysteresis=1.0, max_admit=16, recency_decay=0.75, recency_weight=4000.0, recency_keep=0.9),
}
SHAPES = [(1, 3, 64, 4), (2, 3, 288, 8), (3, 2, 512, 10)]  # seed, layers, experts (288: GLM's; 512: the kernel's most), top-k
STEPS = 96
MAX_ROWS = 4  # rows per decode step (at most Policy.decode_rows)
VERIFY_EVERY = 24  # steps between checks of the tables and the slots' bytes
TWIN_LAYERS = 3  # MoE layers of the trained twin (288 experts, top-8, as the full checkpoint's)


class DeviceStore:
    """What ``ExpertCache`` reads of a ``HostStore``, over random bytes. The blocks the copy kernel reads (the
    store's home addresses) are in device memory here, not mapped host memory: the test is about the decisions, and
    needs no page-locked memory. ``host_block`` gives a CPU copy of the same bytes, as the real store does."""

    def __init__(self, layers: int, experts: int, device: torch.device, seed: int):
        self.layer_keys = [f"model.layers.{i}.mlp" for i in range(layers)]
        self.num_layers, self.num_experts = layers, experts
        self.layout = ExpertLayout.from_shapes(((1, 1, 40),) * 3)  # 80-byte projections, 256-byte aligned: 768 B
        gen = torch.Generator().manual_seed(seed)
        self.blocks = torch.randint(0, 256, (layers, experts, self.layout.block_bytes), dtype=torch.uint8, generator=gen)
        self.device_blocks = self.blocks.to(device)  # [layers, experts, block_bytes]

    def home_addresses(self) -> torch.Tensor:
        index = torch.arange(self.num_layers * self.num_experts, dtype=torch.int64).reshape(self.num_layers, self.num_experts)
        return self.device_blocks.data_ptr() + index * self.layout.block_bytes

    def host_block(self, row: int, expert: int) -> torch.Tensor:
        return self.blocks[row, expert]


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def kernels():
    from glm53.offload.ec_native import Kernels

    return Kernels()


def _pair(kernels, device, seed, layers, experts, top_k, slots, policy, profile):
    """A device cache and the reference, from the same profile (None: a cold start)."""
    store = DeviceStore(layers, experts, device, seed)
    i64 = {"dtype": torch.int64, "device": device}
    tables = [(torch.zeros(experts, **i64), torch.zeros(experts, **i64), torch.zeros(experts, **i64), torch.zeros((experts, 2), **i64))
              for _ in range(layers)]
    cache = ExpertCache(kernels, store, tables, slots, device, top_k, policy, profile)
    warm = np.zeros((layers, experts)) if profile is None else profile
    return cache, ReferenceCache.warm(warm, slots, top_k, policy.decay, policy.recency, policy.warm_horizon)


def _assert_same(cache: ExpertCache, ref: ReferenceCache, where: str, jobs=None) -> None:
    got_freq = cache.freq.cpu().numpy()
    assert np.array_equal(got_freq.view(np.uint32), ref.freq.view(np.uint32)), \
        f"{where}: scores differ at (layer, expert) {np.argwhere(got_freq != ref.freq)[:8].tolist()}"
    for name in ("recent", "reuse"):
        got, want = getattr(cache, name).cpu().numpy(), getattr(ref, name)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{where}: {name} differs at {np.argwhere(got != want)[:8].tolist()}"
    assert np.array_equal(cache.prev.cpu().numpy() != 0, ref.prev), f"{where}: previous picks differ"
    assert np.array_equal(cache.resident(), ref.slot_of), f"{where}: slots differ at {np.argwhere(cache.resident() != ref.slot_of)[:8].tolist()}"
    assert np.array_equal(cache.owners(), ref.owner), f"{where}: slot owners differ"
    assert np.array_equal(cache.picks.cpu().numpy(), ref.picks), f"{where}: per-expert picks differ"
    assert np.array_equal(cache.counters.cpu().numpy(), ref.counters), f"{where}: counters {cache.counters.cpu().numpy().tolist()} want {ref.counters.tolist()}"
    if jobs is not None:
        n = int(cache.num_jobs.item())
        got = [tuple(j) for j in cache.jobs[:n].cpu().numpy().tolist()]
        assert got == jobs, f"{where}: admissions (layer * experts + expert, slot) {got} want {jobs}"


def _drive(cache, ref, trace, policy, device, corrupt=None) -> None:
    """Every step of the trace through both, layer by layer, compared after each; ``corrupt(step)`` may change a
    step's entries before both see them."""
    layers, experts = ref.slot_of.shape
    admit = policy.max_admit if cache.num_slots else 0  # what ExpertCache.routed passes
    _assert_same(cache, ref, "warm start")
    for t, step in enumerate(trace):
        step = corrupt(step) if corrupt else step
        for layer in range(layers):
            sel = torch.from_numpy(np.ascontiguousarray(step[layer])).to(device)  # int64 [rows, top_k], as routing gives
            cache.routed(layer, sel)
            admitted = ref.step(layer, step[layer], policy.decay, policy.hysteresis, admit, policy.recency)
            _assert_same(cache, ref, f"step {t} layer {layer}", [(layer * experts + a.expert, a.slot) for a in admitted])
        if (t + 1) % VERIFY_EVERY == 0 or t + 1 == len(trace):
            assert cache.verify() == [], f"after step {t}"


@pytest.mark.parametrize("seed, layers, experts, top_k", SHAPES)
@pytest.mark.parametrize("kind", ["zipf", "uniform"])
@pytest.mark.parametrize("slots", list(SLOTS))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_kernel_decides_as_the_reference_step_by_step(kernels, device, seed, layers, experts, top_k, kind, slots, policy):
    logw = popularity(seed, kind, layers, experts)
    trace = routing_trace(logw, top_k, STEPS, MAX_ROWS, seed)
    # skewed routing starts warm, from a profile measured on other steps; uniform routing cold (no profile)
    profile = picks_profile(routing_trace(logw, top_k, 40, 1, seed + 100), experts) if kind == "zipf" else None
    total = layers * experts
    cache, ref = _pair(kernels, device, seed, layers, experts, top_k, SLOTS[slots](total), POLICIES[policy], profile)
    _drive(cache, ref, trace, POLICIES[policy], device)
    admitted = int(ref.counters[:, C_ADMITS].sum())
    print(f"{experts} experts, {kind}, {slots} slots ({cache.num_slots}), {policy}: hit rate "
          f"{cache.stats()['hit_rate']}, {admitted} admissions")
    if slots in ("none", "all"):
        assert admitted == 0
    if slots == "partial" or (slots == "one" and kind == "uniform" and policy == "eager"):
        assert admitted > 0  # the comparison saw the kernel admit (a single slot holding the hottest expert keeps it)


@pytest.fixture(scope="module")
def trained_twin():
    """(profile float [layers, experts] the twin's target shares, picks int [steps, layers, 1, top_k])."""
    twin, shares = twin_from_settings("full", "trained", 5, TWIN_LAYERS)
    return shares, twin.run(2 * STEPS, 5).picks[:, :, None, :]


@pytest.mark.parametrize("slots", ["partial", "one"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_kernel_decides_as_the_reference_on_the_trained_twins_routing(kernels, device, trained_twin, slots, policy):
    profile, picks = trained_twin
    layers, experts = profile.shape
    cache, ref = _pair(kernels, device, 4, layers, experts, picks.shape[-1], SLOTS[slots](layers * experts), POLICIES[policy], profile)
    _drive(cache, ref, list(picks), POLICIES[policy], device)
    if POLICIES[policy].recency_weight > 0:
        assert (ref.reuse[:, 0] > ref.reuse[:, 1] + 0.1).all()  # the picks recur: the fast score has weight
    if slots == "partial":
        assert int(ref.counters[:, C_ADMITS].sum()) > 0


def test_entries_outside_the_layer_are_skipped_by_both_and_counted_as_picks_by_both(kernels, device):
    seed, layers, experts, top_k = SHAPES[0]
    trace = routing_trace(popularity(seed, "zipf", layers, experts), top_k, 48, MAX_ROWS, seed)
    rng = np.random.default_rng([seed, 3])

    def corrupt(step):
        step = step.copy()
        outside = rng.random(step.shape) < 0.05
        step[outside] = rng.choice([-1, experts, experts + 7], size=int(outside.sum()))
        return step

    cache, ref = _pair(kernels, device, seed, layers, experts, top_k, layers * experts // 9, Policy(), None)
    _drive(cache, ref, trace, Policy(), device, corrupt)


def test_the_kernel_rounds_like_the_reference_where_float32_and_float64_disagree(kernels, device):
    """Scores set by hand (tests/offload/test_cache_policy.py works them out): a candidate exactly at the
    float32-rounded hysteresis bar is not admitted; three picks of one expert in a step are one float32 addition."""
    policy = Policy(decay=1.0, hysteresis=1.25, max_admit=2, recency_weight=0.0)  # the score is the slow one alone
    cache, ref = _pair(kernels, device, 1, 1, 8, 2, 1, policy, None)  # the one slot holds expert 0
    victim = np.float32(1.0015)
    bar = np.float32(1.25) * victim  # rounded up from the exact product
    freq = np.array([[victim, bar - np.float32(1), 2.0**24, 0, 0, 0, 0, 0]], dtype=np.float32)
    cache.freq.copy_(torch.from_numpy(freq))
    ref.freq[:] = freq
    trace = [np.array([[[1]]]), np.array([[[2], [2], [2]]]), np.array([[[1]]])]  # [layers, rows, top_k] per step
    _drive(cache, ref, trace, policy, device)
    assert ref.slot_of[0].tolist() == [-1, -1, 0, -1, -1, -1, -1, -1]  # expert 1 stayed out at the bar; 2 came in
    assert ref.freq[0, 1] == bar + 1 and ref.freq[0, 2] == 2.0**24 + 4


@pytest.mark.parametrize("policy", ["default", "eager"])
def test_the_host_predicts_each_step_of_the_kernel_from_the_layer_s_rows(kernels, device, trained_twin, policy):
    """The RAM tier's write-back (``tiered.TieredHome.write_back``) predicts the kernel's next step of a layer from
    that layer's rows read before it (``cache.predicted_admissions``): on the trained twin's routing, every step's
    prediction is the kernel's copy jobs."""
    from glm53.offload.cache import predicted_admissions

    shares, picks = trained_twin
    layers, experts = shares.shape
    chosen = POLICIES[policy]
    cache, _ = _pair(kernels, device, 4, layers, experts, picks.shape[-1], SLOTS["partial"](layers * experts), chosen, shares)
    predicted_total = 0
    for step in picks:
        for layer in range(layers):
            rows = [a[layer].cpu().numpy() for a in (cache.freq, cache.recent, cache.prev, cache.reuse, cache.slot_of)]
            predicted = predicted_admissions(chosen, step[layer], *rows)
            cache.routed(layer, torch.from_numpy(np.ascontiguousarray(step[layer])).to(device))
            n = int(cache.num_jobs.item())
            assert [tuple(j) for j in cache.jobs[:n].cpu().numpy().tolist()] == [(layer * experts + a.expert, a.slot) for a in predicted]
            predicted_total += len(predicted)
    assert predicted_total > 0
