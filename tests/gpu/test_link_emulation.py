"""The in-band emulation of a slower link (``native/ec/link_emulate.cuh`` through ``glm53.offload.link``): it holds
for exactly the bytes the kernels read from the host store, decided on the device, and never changes an answer.

- On the expert cache over a stand-in store (``test_cache_policy_kernel``'s): random picks and router weights (some
  0, which the fused decode kernels skip), the cache's own steps (admissions) in between: the misses counted are
  the distinct picked experts of non-zero weight whose tables point home; the fallback's are those with picks in its
  counts; admissions, prefetch-style unit counts, copies and a CPU-tier job's traffic are counted as given; each
  kind's held time is its bytes times the emulated link's added time per byte.
- On the tiny checkpoint in fast mode with a held worker (every job taken back): the fallback's experts are held for,
  and the answer is the one without emulation.

Whether the held time is the target's (the rates under emulation) is measured, not tested: ``bench.bandwidth
--link-emulate-gbs`` (bench/run_fast_link.sh). Exact mode under emulation is bit-identical to stock in
``test_offload_exact.py`` (``cache-11pct-link-emulated``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.offload.cache import ExpertCache, Policy
from glm53.offload.ec_native import LINK_KINDS
from glm53.offload.link import Link, Rates
from tests.gpu.test_cache_policy_kernel import DeviceStore, device, kernels  # noqa: F401 (device, kernels: fixtures)
from tests.offload.test_cache_policy import picks_profile, popularity, routing_trace

LAYERS, EXPERTS, TOP_K = 3, 64, 4
RATES = Rates(zero_copy_gbs=50.0, copy_gbs=55.0)
TARGET = 10.0


def _held(link: Link) -> dict[str, tuple[int, int]]:
    values = link.counters.tolist()
    return {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(LINK_KINDS)}


def _ns(nbytes: int, target: float, measured: float) -> int:
    return int(nbytes * (1 / target - 1 / measured))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_emulation_holds_for_what_the_kernels_read_from_the_host_store(kernels, device, seed):
    store = DeviceStore(LAYERS, EXPERTS, device, seed)
    i64 = {"dtype": torch.int64, "device": device}
    tables = [(torch.zeros(EXPERTS, **i64), torch.zeros(EXPERTS, **i64), torch.zeros(EXPERTS, **i64), torch.zeros((EXPERTS, 2), **i64))
              for _ in range(LAYERS)]
    profile = picks_profile(routing_trace(popularity(seed, "zipf", LAYERS, EXPERTS), TOP_K, 50, 2, seed), EXPERTS)
    link = Link(kernels, device, target_gbs=TARGET, rates=RATES)
    cache = ExpertCache(kernels, store, tables, 16, device, TOP_K, Policy(max_admit=2), profile, link)
    B = cache.block_bytes
    rng = np.random.default_rng(seed)
    want = {name: 0 for name in LINK_KINDS}
    for step in range(40):
        layer = int(rng.integers(LAYERS))
        rows = int(rng.integers(1, 9))
        sel = torch.from_numpy(rng.integers(0, EXPERTS, size=(rows, TOP_K))).to(device)
        before = _held(link)["admissions"][0]
        cache.routed(layer, sel)  # admissions: held on the cache's own stream order
        torch.cuda.synchronize(device)
        admitted = int(cache.num_jobs.item())
        assert _held(link)["admissions"][0] - before == admitted * B
        want["admissions"] += admitted * B
        weights = torch.from_numpy(rng.choice([0.0, 0.25, 0.5], size=(rows, TOP_K)).astype(np.float16)).to(device)
        at_home = cache.resident()[layer] < 0
        read = {int(e) for e, w in zip(sel.cpu().numpy().ravel(), weights.cpu().numpy().ravel()) if w != 0 and at_home[e]}
        link.misses(cache.state, layer, sel, weights, B)
        want["misses"] += len(read) * B
        every = {int(e) for e in sel.cpu().numpy().ravel() if at_home[e]}
        link.misses(cache.state, layer, sel, None, B)  # no weights: every pick is read
        want["misses"] += len(every) * B
        count = torch.zeros(EXPERTS + 1, **i64)
        fallen = rng.choice(EXPERTS, size=3, replace=False)
        count[torch.from_numpy(fallen).to(device)] = 1
        count[EXPERTS] = 5  # the last bin is never read
        link.fallback(cache.state, layer, count, B)
        want["fallback"] += sum(1 for e in fallen if at_home[e]) * B
        n = torch.tensor([int(rng.integers(0, 3))], dtype=torch.int32, device=device)
        link.units(n, B, "prefetch", 4)
        want["prefetch"] += int(n.item()) * B
        status = torch.tensor([int(rng.integers(0, 2))], **i64)  # 0: not published
        outcome = torch.tensor([int(rng.integers(0, 3))], dtype=torch.int32, device=device)  # 1: delivered
        link.tier_io(status, outcome, 1000, 3000)
        want["tier_io"] += (1000 if status.item() else 0) + (3000 if outcome.item() == 1 else 0)
        link.copied(7 * B)
        want["copies"] += 7 * B
    torch.cuda.synchronize(device)
    held = _held(link)
    for name, nbytes in want.items():
        assert held[name][0] == nbytes, f"{name}: held for {held[name][0]} bytes, read {nbytes}"
    # each hold is its bytes times the added time per byte (ns rounded down per hold: within one ns a hold)
    for name in ("misses", "fallback", "admissions", "prefetch", "tier_io"):
        assert _ns(held[name][0], TARGET, RATES.zero_copy_gbs) - 200 <= held[name][1] <= _ns(held[name][0], TARGET, RATES.zero_copy_gbs) + 1
    assert _ns(held["copies"][0], TARGET, RATES.copy_gbs) - 40 <= held["copies"][1] <= _ns(held["copies"][0], TARGET, RATES.copy_gbs) + 1


def test_the_full_link_launches_nothing_and_a_faster_target_is_refused(kernels, device):
    link = Link(kernels, device, rates=RATES)
    assert not link.emulating
    link.copied(1 << 20)
    torch.cuda.synchronize(device)
    assert link.counters.sum().item() == 0
    with pytest.raises(ValueError, match="GLM53_LINK_EMULATE_GBS=60.0 is not accepted: this machine's link was measured at 50.0"):
        link.retarget(60.0)
    link.retarget(50.0)  # the zero-copy reads' measured rate: held for nothing more, but counted; copies (55) are slower
    link.probed(1 << 20, 4)
    link.copied(1 << 20)
    torch.cuda.synchronize(device)
    assert _held(link)["probe"] == (1 << 20, 0)
    assert _held(link)["copies"] == (1 << 20, _ns(1 << 20, 50.0, RATES.copy_gbs))


def test_a_fast_engine_under_emulation_holds_for_its_fallbacks_and_answers_as_without(tiny_checkpoint):
    from tests.cpu_tier.host_producer import debug_hold
    from tests.gpu.test_fast_tier import CPU_TAKES_THE_MISSES, _backend, _greedy

    answers, held = {}, None
    for emulated in (False, True):
        extra = [*CPU_TAKES_THE_MISSES, "--ct-threads", "2", "--ct-deadline-ms", "5"] + (["--link-emulate-gbs", "10"] if emulated else [])
        backend = _backend(tiny_checkpoint, "fast", extra)
        try:
            debug_hold(backend.offload.tier.worker, True)  # every job is taken back: the GPU falls back
            answers[emulated] = [t.token_id for t in _greedy(backend)]
            debug_hold(backend.offload.tier.worker, False)
            stats, block = backend.offload.stats(), backend.offload.store.layout.block_bytes
        finally:
            backend.close()
            torch.cuda.empty_cache()
        if emulated:
            held, device = stats["link"]["held"], stats["cpu_tier"]["device"]
    print(f"held: {held}")
    assert answers[True] == answers[False]
    assert device["fallback_experts"] > 0 and held["fallback"]["seconds"] > 0
    assert held["fallback"]["bytes"] == device["fallback_experts"] * block  # every expert taken back is read from home
    assert held["tier_io"]["bytes"] > 0  # the jobs' inputs were published (none delivered)
    assert held["misses"]["bytes"] > 0
