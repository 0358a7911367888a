"""Predictive prefetch's device side (``native/ec/prefetch.cuh`` through ``glm53.offload.prefetch``) against its
policy (``glm53.offload.prefetch_policy``), on the expert cache over a stand-in store (``test_cache_policy_kernel``'s:
random bytes, no model):

- a plan copies exactly ``fill_pool``'s experts, in its order, points their table entries at the pool's slots and
  brings their bytes there; the release points them home again (the tables then verify) and counts what the
  layer's picks used; with scores and a threshold (scores on the threshold itself, NaNs, repeats), and a copy
  budget below the pool's slots;
- the prefetcher's hooks, driven as the offload drives them (routing, the cache's step, the layer's end) with the
  oracle (the true picks), copy and use every non-resident pick the pool holds, and leave the cache's decisions as
  without prefetch.

Exactness on a model (tiny and scaled checkpoints, prefetch on) is in ``test_offload_exact.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.offload.cache import ExpertCache, Policy
from glm53.offload.prefetch_policy import budget_copies, fill_pool
from tests.gpu.test_cache_policy_kernel import DeviceStore, device, kernels  # noqa: F401 (device, kernels: fixtures)
from tests.offload.test_cache_policy import picks_profile, popularity, routing_trace

LAYERS, EXPERTS, TOP_K, HIDDEN = 3, 64, 4, 16


def _cache(kernels, device, seed, slots):
    store = DeviceStore(LAYERS, EXPERTS, device, seed)
    i64 = {"dtype": torch.int64, "device": device}
    tables = [(torch.zeros(EXPERTS, **i64), torch.zeros(EXPERTS, **i64), torch.zeros(EXPERTS, **i64), torch.zeros((EXPERTS, 2), **i64))
              for _ in range(LAYERS)]
    profile = picks_profile(routing_trace(popularity(seed, "zipf", LAYERS, EXPERTS), TOP_K, 50, 2, seed), EXPERTS)
    return store, tables, ExpertCache(kernels, store, tables, slots, device, TOP_K, Policy(), profile)


def _prefetcher(kernels, cache, device, slots, extra=0, lead=False):
    from glm53.offload.prefetch import Prefetcher

    gen = torch.Generator().manual_seed(3)
    routers = [(torch.randn(HIDDEN, EXPERTS, generator=gen).half().to(device), torch.zeros(EXPERTS)) for _ in range(LAYERS)]
    return Prefetcher(kernels, cache, routers, slots, extra, TOP_K, device, max_rows=2, lead=lead)  # the traces' steps are two rows


def _scores(rng, shape, threshold: float) -> np.ndarray:
    """float32 scores around ``threshold``: a quarter exactly on it, a few NaN, the next float32 either side."""
    t = np.float32(threshold)
    choices = np.array([t, np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(2)), np.nan], dtype=np.float32)
    scores = rng.uniform(0.0, 1.2, size=shape).astype(np.float32)
    pick = rng.random(shape)
    scores[pick < 0.25] = choices[rng.integers(0, 4, size=shape)][pick < 0.25]
    return scores


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("slots", [1, 2, 6])
@pytest.mark.parametrize("threshold, budget", [(None, None), (0.85, None), (0.5, 1)])
def test_a_plan_copies_fill_pools_experts_and_the_release_points_them_home(kernels, device, seed, slots, threshold, budget):
    store, tables, cache = _cache(kernels, device, seed, slots=24)
    pf = _prefetcher(kernels, cache, device, slots)
    rng = np.random.default_rng(seed)
    copies = slots if budget is None else budget
    for trial in range(20):
        layer = int(rng.integers(LAYERS))
        rows, n_pred = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        predicted = rng.integers(-1, EXPERTS, size=(rows, n_pred))  # -1: out of range, ignored; repeats happen
        resident = cache.resident()[layer] >= 0
        scores = None if threshold is None else _scores(rng, predicted.shape, threshold)
        want = fill_pool(predicted, resident, min(slots, copies), scores, threshold)
        kernels.prefetch(cache.state, pf.state, layer, torch.from_numpy(predicted).to(device), copies, cache.block_bytes, 4,
                         None if scores is None else torch.from_numpy(scores).to(device),
                         float("-inf") if threshold is None else threshold)
        torch.cuda.synchronize(device)
        n = int(pf.num.item())
        assert [o - layer * EXPERTS for o in pf.owner[:n].tolist()] == want, f"trial {trial}: plan"
        gate = tables[layer][0].cpu()
        for j, e in enumerate(want):
            assert int(gate[e]) == int(pf.slot_addr[j]), f"trial {trial}: expert {e} not pointed at pool slot {j}"
            assert torch.equal(pf.buffer[j].cpu(), store.blocks[layer, e]), f"trial {trial}: expert {e}'s bytes"
        picks = rng.integers(0, EXPERTS, size=(2, TOP_K))
        before = pf.counters[layer].tolist()
        kernels.prefetch_release(cache.state, pf.state, layer, torch.from_numpy(picks).to(device))
        torch.cuda.synchronize(device)
        used = sum(e in picks for e in want)
        copied, got_used, wasted, plans = (a - b for a, b in zip(pf.counters[layer].tolist(), before))
        assert (copied, got_used, wasted, plans) == (0, used, len(want) - used, 0), f"trial {trial}: counters"
        assert int(pf.num.item()) == 0 and (pf.owner == -1).all()
        assert cache.verify() == [], f"trial {trial}: tables after the release"


@pytest.mark.parametrize("lead", [False, True])
def test_the_oracle_prefetches_every_miss_the_pool_holds_and_the_cache_decides_as_without_it(kernels, device, lead):
    trace = routing_trace(popularity(7, "zipf", LAYERS, EXPERTS), TOP_K, 40, 2, 7)  # per step: [layers, rows, top_k]
    slots = 2 * TOP_K  # room for every pick of a step's two rows
    results = {}
    for with_prefetch in (False, True):
        _, _, cache = _cache(kernels, device, 11, slots=24)
        pf = _prefetcher(kernels, cache, device, slots, lead=lead)
        if with_prefetch:
            pf.replay([torch.from_numpy(np.ascontiguousarray(step[l])).to(device) for step in trace for l in range(LAYERS)])
        misses = 0
        for step in trace:
            if with_prefetch:
                pf.forward_start()
                pf.decode_start(step.shape[1])  # as the offload calls them at a decode forward's start
            for l in range(LAYERS):
                sel = torch.from_numpy(np.ascontiguousarray(step[l])).to(device)
                resident = cache.resident()[l] >= 0
                misses += len({int(e) for e in step[l].reshape(-1) if not resident[e]}) if l > 0 or lead else 0
                if with_prefetch:
                    pf.routed(l, sel, None, torch.zeros((sel.shape[0], HIDDEN), dtype=torch.float16, device=device))
                cache.routed(l, sel)
                if with_prefetch:
                    pf.after_layer(l)
        torch.cuda.synchronize(device)
        assert cache.verify() == []
        results[with_prefetch] = (cache.resident().copy(), cache.counters.cpu().numpy().copy(), pf.stats(), misses)
    (res0, ctr0, _, _), (res1, ctr1, stats, misses) = results[False], results[True]
    assert np.array_equal(res0, res1) and np.array_equal(ctr0, ctr1)  # the cache's decisions are prefetch's blind spot
    # layer 0 is prefetched only by the lead (nothing comes before it in a step); every other layer's distinct misses are
    assert stats["copied"] == stats["used"] == misses and stats["wasted"] == 0
    assert stats["plans"] == len(trace) * (LAYERS - (0 if lead else 1)) and stats["lead"] is lead


def test_the_lead_predicts_the_first_layer_by_its_previous_step_and_skips_a_step_of_other_rows(kernels, device):
    _, _, cache = _cache(kernels, device, 5, slots=0)  # nothing resident: every pick is a miss
    pf = _prefetcher(kernels, cache, device, TOP_K, lead=True)
    z = torch.zeros((1, HIDDEN), dtype=torch.float16, device=device)
    first = torch.tensor([[3, 5, 7, 9]], device=device)
    pf.forward_start()
    pf.decode_start(1)  # no step before: nothing to predict by
    assert not pf.schedule.planned[0]
    pf.routed(0, first, None, z)
    cache.routed(0, first)
    pf.after_layer(0)
    pf.forward_start()
    pf.decode_start(1)
    assert pf.schedule.planned[0]
    pf.routed(0, first, None, z)  # the same picks again: all four come from the pool
    cache.routed(0, first)
    pf.after_layer(0)
    torch.cuda.synchronize(device)
    layer0 = pf.stats()["per_layer"][0]
    pf.forward_start()  # the step stopped after layer 0: the next forward releases layer 1's plan, as an engine's would
    assert layer0["plans"] == 1 and layer0["copied"] == layer0["used"] == 4 and cache.verify() == []
    pf.forward_start()
    pf.decode_start(2)  # a step of two rows is not predicted by one of one
    assert not pf.schedule.planned[0]


def test_a_threshold_above_every_score_copies_nothing_and_one_below_every_score_copies_as_none(kernels, device):
    trace = routing_trace(popularity(9, "zipf", LAYERS, EXPERTS), TOP_K, 20, 1, 9)
    gen = torch.Generator().manual_seed(4)
    zs = [torch.randn((1, HIDDEN), generator=gen).half().to(device) for _ in range(len(trace) * LAYERS)]
    copied = {}
    for min_score in (None, -10.0, 10.0):
        _, _, cache = _cache(kernels, device, 13, slots=0)  # nothing resident: every prediction is a candidate
        pf = _prefetcher(kernels, cache, device, TOP_K)
        pf.min_score = min_score
        z = iter(zs)
        for step in trace:
            pf.forward_start()
            for l in range(LAYERS):
                sel = torch.from_numpy(np.ascontiguousarray(step[l])).to(device)
                pf.routed(l, sel, None, next(z))
                cache.routed(l, sel)
                pf.after_layer(l)
        pf.forward_start()
        torch.cuda.synchronize(device)
        stats = pf.stats()
        assert cache.verify() == [] and stats["plans"] == len(trace) * (LAYERS - 1)
        copied[min_score] = stats["copied"]
    assert copied[None] == copied[-10.0] == len(trace) * (LAYERS - 1) * TOP_K and copied[10.0] == 0


def test_the_window_clock_times_the_compute_streams_gap_and_the_budget_follows_it(device):
    from glm53.offload.prefetch import CopyBudget, WindowClock

    clock = WindowClock(LAYERS, every=2)
    for _ in range(4):  # forwards 0 and 2 are sampled
        clock.forward_start()
        clock.start(1)
        torch.cuda._sleep(2_000_000)  # some GPU cycles between a layer's end and the next routing
        clock.end(1)
    torch.cuda.synchronize(device)
    clock.forward_start()
    assert len(clock.samples[1]) == 2 and clock.window_s(1) > 0 and clock.window_s(2) is None
    budget = CopyBudget(copy_gbs=50.0, block_bytes=1_000_000, layers=LAYERS, clock=clock)
    window = clock.window_s(1)
    assert budget.copies(1, 16) == min(16, budget_copies(window, 50.0, 1_000_000)) >= 1 and budget.copies(2, 3) == 3
