"""A busy host, on the CPU: with a CPU hog on every CPU the tier may use, the real worker and pool (the expert kernel
on GLM-5.3-Flash's expert shapes, random trellis bits) take longer per expert, and the live refresh of the cost
model (``Costs.refreshed``, what ``FastTier`` does every ``REFRESH_STEPS`` steps) then sends the CPU fewer misses
or none. The engine's side (the split on the device, shadow jobs) is tested with stand-ins in test_tier.py
and on the GPU in tests/gpu/test_fast_tier.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from bench.cpu_hog import CpuHog
from glm53.cpu_tier import kernel as ce
from glm53.cpu_tier import worker as ct
from glm53.cpu_tier.split import Costs
from tests.cpu_tier.host_producer import HostProducer, Outcome

HIDDEN, INTER, K = 4096, 2048, 3  # GLM-5.3-Flash's routed expert at 3 bits: ~9.4 MB of trellis
EXPERTS, JOBS, PER_JOB = 4, 8, 4
MISSES = 20  # a decode layer's misses the split is looked up for (3 hits, 1 token)


def _expert(rng) -> tuple[ce.Linear, ce.Linear, ce.Linear]:
    def linear(n_in, n_out, rms_out):
        trellis = rng.integers(0, 1 << 16, size=(n_in // 16, n_out // 16, 16 * K), dtype=np.uint16).view(np.int16)
        suh = (rng.choice([-1.0, 1.0], n_in) * rng.uniform(0.5, 1.5, n_in)).astype(np.float16)
        svh = (rng.choice([-1.0, 1.0], n_out) * rng.uniform(0.5, 1.5, n_out) * rms_out / (1.08 * np.sqrt(n_in))).astype(np.float16)
        return ce.Linear(trellis, suh, svh)

    return linear(HIDDEN, INTER, 6.0), linear(HIDDEN, INTER, 6.0), linear(INTER, HIDDEN, 1 / 8)


@pytest.fixture(scope="module")
def worker():
    rng = np.random.default_rng(7)
    experts = {(0, e): _expert(rng) for e in range(EXPERTS)}
    table = ct.ExpertTable(experts, 1, EXPERTS)
    ring = ct.Ring(slots=2, hidden=HIDDEN)
    with ce.Pool(threads=max(1, len(os.sched_getaffinity(0)) - 1), spin_us=100) as pool, \
            ct.Worker(ring, table, act_limit=10.0, pool=pool, spin_us=100, codebook="fma") as w:
        yield w, HostProducer(ring), rng


def _busy_per_expert(worker, producer, rng) -> float:
    before = worker.counters()
    for j in range(JOBS):
        picks = [(0, (j * PER_JOB + i) % EXPERTS, 0.25) for i in range(PER_JOB)]
        seq = producer.publish(0, rng.standard_normal((1, HIDDEN)).astype(np.float16), picks)
        assert producer.wait(seq, 30.0) == Outcome("done")
        producer.result(seq)  # read: the slot is free again
    after = worker.counters()
    return (after["busy_s"] - before["busy_s"]) / (after["experts"] - before["experts"])


def test_a_cpu_hog_slows_the_worker_and_the_refreshed_split_sends_the_cpu_fewer_misses(worker):
    if os.getloadavg()[0] > 0.75 * len(os.sched_getaffinity(0)):
        pytest.skip(f"the machine is busy already (load {os.getloadavg()[0]:.1f}): the quiet figure would not be quiet")
    w, producer, rng = worker
    _busy_per_expert(w, producer, rng)  # warm: pages touched, threads started
    quiet = min(_busy_per_expert(w, producer, rng) for _ in range(3))  # the least disturbed of three windows
    with CpuHog(os.sched_getaffinity(0)):
        busy = _busy_per_expert(w, producer, rng)
    print(f"per expert: quiet {quiet * 1e3:.2f} ms, with a hog on every CPU {busy * 1e3:.2f} ms")
    assert busy > 1.3 * quiet
    # the cost model at the quiet rate, with a link that reads an expert in 1.5x that time: the CPU takes a share of
    # a layer's 20 misses (with 5, one expert less on the CPU costs the GPU 1.5 experts' time, and a refresh that
    # moves halfway to a 1.6x slower host would still leave the split as it was)
    model = Costs({1: quiet}, handoff_s=0.0, link_expert_s=1.5 * quiet, vram_expert_s=0.0)
    quiet_share = int(model.table(8, 64)[1, 3, MISSES])
    assert quiet_share >= 2
    # one refresh with what the worker reported under the hog (the window's busy time over its experts)
    loaded = model.refreshed(busy_s=busy * JOBS * PER_JOB, experts=JOBS * PER_JOB, tokens=1, jobs=JOBS)
    assert int(loaded.table(8, 64)[1, 3, MISSES]) < quiet_share
