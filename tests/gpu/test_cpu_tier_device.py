"""The CPU tier's handoff with the GPU as the producer (glm53.cpu_tier.device, native/ec/cpu_tier_device.cuh):
jobs published by CUDA kernels into mapped host memory, computed by the host worker, collected on the device;
late jobs taken back while the worker may be finishing them. Same random experts as tests/cpu_tier/test_worker.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from glm53.cpu_tier import kernel as ce
from glm53.cpu_tier import worker as ct
from tests.cpu_tier.host_producer import debug_hold
from tests.cpu_tier.test_worker import (  # noqa: F401 (tier: fixture)
    HIDDEN,
    LIMIT,
    SEED,
    random_job,
    reference,
    tier,
    wait_for,
)

DEVICE = torch.device("cuda", 0)


def fallback_reference(record, T, topk, num_experts, fall):
    """What ct_fallback_plan_kernel writes: (count [E + 1], tokens [n], weights [n]) for exllamav3's fused kernel."""
    n = T * topk
    bins = [record[q] if fall and record[q] >= 0 else num_experts for q in range(n)]
    count = [bins.count(e) for e in range(num_experts + 1)]
    order = sorted(range(n), key=lambda q: (bins[q], q))
    tokens = [q // topk for q in order]
    weights = [np.array([record[64 + q]], np.uint16).view(np.float16)[0] if bins[q] < num_experts else np.float16(0) for q in order]
    return count, tokens, weights


def _device_job(job):
    layer, x, picks = job
    t, e, w = (torch.tensor(v) for v in zip(*picks))
    from glm53.cpu_tier.device import pack_picks

    return layer, torch.from_numpy(x).to(DEVICE), pack_picks(t, e, w).to(DEVICE)


@pytest.fixture
def pool():
    with ce.Pool(threads=2, spin_us=100) as p:
        yield p


def test_jobs_published_by_the_gpu_come_back_bit_exact(tier, pool):
    from glm53.cpu_tier.device import OUTCOMES, DeviceProducer

    _, table, experts = tier
    rng = np.random.default_rng([SEED, 11])
    ring = ct.Ring(slots=4, hidden=HIDDEN)
    producer = DeviceProducer(ring, DEVICE)
    try:
        with ct.Worker(ring, table, act_limit=LIMIT, pool=pool) as worker:
            for _ in range(24):  # rounds of 1..4 jobs in flight at once (the ring has 4 slots)
                jobs = [random_job(rng) for _ in range(int(rng.integers(1, 5)))]
                sent = []
                for job in jobs:
                    layer, x, picks = _device_job(job)
                    sent.append((producer.publish(layer, x, picks), torch.zeros((x.shape[0], HIDDEN), dtype=torch.float32, device=DEVICE)))
                outcomes = [producer.collect(status, acc, timeout_s=10.0) for status, acc in sent]
                for job, (status, acc), outcome in zip(jobs, sent, outcomes):
                    assert OUTCOMES[int(outcome)] == "done"
                    got = acc.cpu().numpy()
                    assert np.array_equal(got, reference(experts, *job)), _slot_now(ring, int(status), experts, job, got)
            counters = worker.counters()
        stats = producer.stats()
        print(f"native host atomics: {stats['native_host_atomics']}; producer {stats}; worker {counters}")
        assert stats["published"] == stats["done"] == counters["done"] == counters["jobs"] > 24
        assert all(ring.free(s) for s in range(4))
    finally:
        producer.close()


def test_a_late_job_is_taken_back_before_or_after_the_claim(tier):
    from glm53.cpu_tier.device import OUTCOMES, DeviceProducer

    _, table, experts = tier
    rng = np.random.default_rng([SEED, 12])
    ring = ct.Ring(slots=1, hidden=HIDDEN)
    producer = DeviceProducer(ring, DEVICE)
    try:
        job = random_job(rng, tokens=2, picks=3)
        layer, x, picks = _device_job(job)
        acc = torch.zeros((2, HIDDEN), dtype=torch.float32, device=DEVICE)
        # no worker: never claimed
        outcome = producer.collect(producer.publish(layer, x, picks), acc, timeout_s=0.002)
        assert OUTCOMES[int(outcome)] == "taken_back_before_claim"
        assert ring.word(0) == (1, "taken_back") and not ring.free(0)  # free once the worker has passed it
        with ct.Worker(ring, table, act_limit=LIMIT) as worker:
            wait_for(lambda: ring.ack(0) == (1, "skipped"))
            debug_hold(worker, True)  # claimed, then held past the deadline
            status = producer.publish(layer, x, picks)
            outcome = producer.collect(status, acc, timeout_s=0.05)
            assert OUTCOMES[int(outcome)] == "taken_back_after_claim"
            assert ring.word(0) == (2, "taken_back") and not acc.any()  # nothing added
            # the slot is still the worker's: the next job cannot be published and says so
            busy = producer.publish(layer, x, picks)
            assert int(busy) == 0 and OUTCOMES[int(producer.collect(busy, acc, timeout_s=1.0))] == "none"
            debug_hold(worker, False)
            wait_for(lambda: ring.free(0))
            assert ring.ack(0) == (2, "done")  # computed and published, never used
            outcome = producer.collect(producer.publish(layer, x, picks), acc, timeout_s=10.0)
            assert OUTCOMES[int(outcome)] == "done" and np.array_equal(acc.cpu().numpy(), reference(experts, *job))
            c = worker.counters()
        stats = producer.stats()
        assert (c["jobs"], c["done"], c["taken_back_before_claim"], c["taken_back_after_claim"]) == (2, 1, 1, 1)
        assert (stats["published"], stats["busy"], stats["done"], stats["taken_back_before_claim"], stats["taken_back_after_claim"]) == (3, 1, 1, 1, 1)
    finally:
        producer.close()


def _wrong_partial(experts, job, got, recent) -> str:
    """What a DONE partial that is not the job's own matches, of the ways the ring could go wrong: an earlier job's
    result (a stale out), this job's picks on an earlier job's input (a stale x: the worker read the slot before the
    GPU's writes landed), or the job's own result plus an earlier one (a double add)."""
    layer, x, picks = job
    for age, (p_layer, p_x, p_picks) in enumerate(recent, 1):
        earlier = reference(experts, p_layer, p_x, p_picks)
        if np.array_equal(got, earlier):
            return f"it is the result of the job {age} before (a stale out)"
        if p_x.shape == x.shape and np.array_equal(got, reference(experts, layer, p_x, picks)):
            return f"it is this job's picks on the input of the job {age} before (a stale x)"
        if np.allclose(got, reference(experts, *job) + earlier, rtol=1e-5, atol=1e-6):
            return f"it is this job's result plus that of the job {age} before (a double add)"
    return f"it matches none of the last {len(recent)} jobs' results, inputs or sums"


def _slot_now(ring, seq: int, experts, job, got) -> str:
    """Where a wrong DONE partial went wrong, from the slot as the host reads it afterwards (nothing has been published
    into it since): the worker's out against the reference and against what the GPU added, the slot's x against the
    job's. out right but the GPU's sum wrong: the device read the out early; out wrong on the right x: the worker
    computed on other bytes than those there now (read before the GPU's writes landed) or its compute is not
    deterministic; x wrong: the GPU's publish did not write the job's rows."""
    layer, x, picks = job
    slot = seq % ring.layout.slots
    out, slot_x = ring.out(slot, x.shape[0]).copy(), ring.x(slot, x.shape[0]).copy()
    want = reference(experts, *job)
    return (f"slot {slot} of job {seq} now: out {'== reference' if np.array_equal(out, want) else '!= reference'}, "
            f"out {'==' if np.array_equal(out, got) else '!='} what the GPU added, x {'==' if np.array_equal(slot_x, x) else '!='} "
            f"the job's x (max |out - reference| {np.abs(out - want).max():.3g}); ack {ring.ack(slot)}, job {ring.word(slot)}")


def test_deadlines_racing_the_worker_never_lose_nor_double_count_a_job(tier, pool):
    """Deadlines around the worker's compute time: the GPU's take-back and the worker's completion cross; every job
    ends exactly one way on the GPU's side (a DONE partial exact, a taken-back job adds nothing), the worker reaches
    each once, and its counters bound the GPU's outcomes (each side may see the other's word when they cross)."""
    from glm53.cpu_tier.device import OUTCOMES, DeviceProducer

    _, table, experts = tier
    rng = np.random.default_rng([SEED, 13])
    ring = ct.Ring(slots=2, hidden=HIDDEN)
    producer = DeviceProducer(ring, DEVICE)
    ends = {name: 0 for name in OUTCOMES}
    recent = []  # the last jobs, newest first: what a wrong partial is compared with
    try:
        with ct.Worker(ring, table, act_limit=LIMIT, pool=pool, spin_us=100000) as worker:
            for i in range(300):
                job = random_job(rng, tokens=1)
                layer, x, picks = _device_job(job)
                acc = torch.zeros((1, HIDDEN), dtype=torch.float32, device=DEVICE)
                status = producer.publish(layer, x, picks)
                outcome = OUTCOMES[int(producer.collect(status, acc, timeout_s=float(rng.uniform(0, 300e-6))))]
                ends[outcome] += 1
                if outcome == "done":
                    got = acc.cpu().numpy()
                    assert np.array_equal(got, reference(experts, *job)), \
                        f"job {i}: {_wrong_partial(experts, job, got, recent)}; {_slot_now(ring, int(status), experts, job, got)}"
                else:
                    assert not acc.any(), f"job {i}: {outcome} but something was added"
                recent = [job, *recent[:2]]
                if outcome != "done":  # the slot comes back when the worker has passed the job
                    wait_for(lambda: ring.free(0) and ring.free(1))
            wait_for(lambda: ring.worker_next() == 301)
            c = worker.counters()
        print(f"outcomes {ends}; worker {c}; producer {producer.stats()}")
        assert ends["none"] == 0 and ends["failed"] == 0 and sum(ends.values()) == 300
        assert c["jobs"] + c["taken_back_before_claim"] == 300
        assert c["jobs"] == c["done"] + c["taken_back_after_claim"] and c["failed"] == 0
        assert c["done"] >= ends["done"]
        assert c["taken_back_before_claim"] >= ends["taken_back_before_claim"]
        assert c["jobs"] <= ends["done"] + ends["taken_back_after_claim"]
        assert min(ends["done"], ends["taken_back_before_claim"] + ends["taken_back_after_claim"]) > 0  # both ways seen
    finally:
        producer.close()


def test_round_trip_latency(tier, pool):
    """Figures, not a check: publish -> host compute -> collect of one token's 8 experts, measured on the device."""
    from glm53.cpu_tier.device import DeviceProducer

    _, table, _ = tier
    rng = np.random.default_rng([SEED, 14])
    ring = ct.Ring(slots=4, hidden=HIDDEN)
    producer = DeviceProducer(ring, DEVICE)
    try:
        with ct.Worker(ring, table, act_limit=LIMIT, pool=pool, spin_us=100000) as worker:
            jobs = [_device_job(random_job(rng, tokens=1, picks=8)) for _ in range(200)]
            acc = torch.zeros((1, HIDDEN), dtype=torch.float32, device=DEVICE)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for layer, x, picks in jobs[:20]:  # warm-up
                producer.collect(producer.publish(layer, x, picks), acc, 1.0)
            torch.cuda.synchronize()
            start.record()
            for layer, x, picks in jobs:
                producer.collect(producer.publish(layer, x, picks), acc, 1.0)
            end.record()
            torch.cuda.synchronize()
            per_job_us = start.elapsed_time(end) * 1000 / len(jobs)
            c = worker.counters()
        figures = {"jobs": len(jobs), "experts_per_job": 8, "hidden": HIDDEN, "per_job_us": round(per_job_us, 1),
                   "worker_busy_us_per_job": round(c["busy_s"] * 1e6 / c["jobs"], 1), "native_host_atomics": producer.native_host_atomics}
        print(f"round trip: {figures}")
        report = Path(os.environ.get("REPORT_DIR", "/tmp"))
        report.mkdir(parents=True, exist_ok=True)
        (report / "cpu-tier-device-latency.json").write_text(json.dumps(figures, indent=1) + "\n")
        assert producer.stats()["done"] == len(jobs) + 20
    finally:
        producer.close()


def test_the_split_kernel_matches_the_reference_and_the_worker_computes_what_it_sent(tier, pool):
    """Fast mode's split (ct_split_publish_kernel) on random decode steps against split.split_reference: the same
    counts, the same weights left to the GPU (the CPU's zeroed), and the worker's partial for the job it published
    equals the CPU reference of those picks."""
    from glm53.cpu_tier.split import Costs, split_reference
    from glm53.cpu_tier.device import OUTCOMES, DeviceProducer
    from tests.cpu_tier.test_worker import EXPERTS, LAYERS

    _, expert_table, experts = tier
    rng = np.random.default_rng([SEED, 15])
    costs = Costs({1: 250e-6, 2: 280e-6, 4: 350e-6, 8: 500e-6}, handoff_s=15e-6, link_expert_s=370e-6, vram_expert_s=5e-6)
    cube = costs.table(max_tokens=8, max_experts=64)
    cube_d = torch.from_numpy(cube).to(DEVICE)
    ring = ct.Ring(slots=2, hidden=HIDDEN)
    producer = DeviceProducer(ring, DEVICE)
    sent = 0
    try:
        with ct.Worker(ring, expert_table, act_limit=LIMIT, pool=pool):
            for case in range(60):
                T, topk = int(rng.integers(1, 9)), 8
                sel = np.stack([rng.choice(EXPERTS, topk, replace=False) for _ in range(T)]).astype(np.int64)
                rw = rng.uniform(0.01, 0.3, (T, topk)).astype(np.float16)
                slot_of = np.where(rng.random(EXPERTS) < 0.3, rng.integers(0, 100, EXPERTS), -1).astype(np.int32)
                if case % 5 == 0:
                    slot_of = np.arange(EXPERTS, dtype=np.int32)  # every expert in VRAM: nothing to send
                freq = rng.random(EXPERTS).astype(np.float32)
                if case % 3 == 0:
                    freq = np.round(freq, 1)  # ties: the lower expert index is colder
                layer = int(rng.integers(0, LAYERS))
                y = rng.standard_normal((T, HIDDEN)).astype(np.float16)
                want_picks, want_rw, want_info = split_reference(sel, rw, slot_of, freq, cube)
                rw_d = torch.from_numpy(rw).to(DEVICE)
                status, info, record = producer.split_publish(
                    layer, torch.from_numpy(sel).to(DEVICE), rw_d, torch.from_numpy(y).to(DEVICE),
                    torch.from_numpy(slot_of).to(DEVICE), torch.from_numpy(freq).to(DEVICE), cube_d)
                acc = torch.zeros((T, HIDDEN), dtype=torch.float32, device=DEVICE)
                outcome_d = producer.collect(status, acc, timeout_s=10.0)
                outcome = OUTCOMES[int(outcome_d)]
                # the record of the moved picks, and the fallback's plan: nothing when the job arrived (or was never
                # published); the moved picks, sorted by expert, when it had not (an outcome written here)
                moved = {(t, e): w for t, e, w in want_picks}
                rec = record.cpu().tolist()
                assert rec[:T * topk] == [int(sel.flat[q]) if (q // topk, int(sel.flat[q])) in moved else -1 for q in range(T * topk)]
                for q in range(T * topk):
                    if rec[q] >= 0:
                        assert np.uint16(rec[64 + q]) == rw.reshape(-1).view(np.uint16)[q]
                for fall_outcome in (outcome_d, torch.tensor([3], dtype=torch.int32, device=DEVICE)):
                    count, tokens, weights = producer.fallback_plan(status, fall_outcome, record, T, topk, EXPERTS)
                    want = fallback_reference(rec, T, topk, EXPERTS, int(status) != 0 and int(fall_outcome) != 1)
                    assert (count.tolist(), tokens.tolist()) == want[:2], f"case {case}"
                    assert np.array_equal(weights.cpu().numpy().view(np.uint16), np.array(want[2], np.float16).view(np.uint16))
                assert info.tolist() == [want_info[k] for k in ("hits", "misses", "experts", "picks")], f"case {case}"
                assert np.array_equal(rw_d.cpu().numpy().view(np.uint16), want_rw.view(np.uint16)), f"case {case}"
                if want_picks:
                    sent += 1
                    assert outcome == "done", f"case {case}"
                    assert np.array_equal(acc.cpu().numpy(), reference(experts, layer, y, want_picks)), f"case {case}"
                else:
                    assert int(status) == 0 and outcome == "none" and not acc.any()
        assert 10 < sent < 60  # both kinds of step were seen
    finally:
        producer.close()
