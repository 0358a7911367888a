"""The CPU tier's handoff (glm53.cpu_tier.worker, native/cpu_tier): ring, worker, take-back, on the CPU.

Small shapes (hidden 256, intermediate 128, 16 experts in 2 layers, K = 3) with fresh random trellis bits read
into a real HostStore; HostProducer stands in for the GPU. Every run draws a seed it prints;
CPU_TIER_TEST_SEED=<seed> repeats it.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from glm53.cpu_tier import kernel as ce
from glm53.cpu_tier import worker as ct
from glm53.offload.host_store import HostStore

from glm53.native.cpu import library
from glm53.native.cpu_binding import GLM53_CT_SUM, GLM53_CT_SUM_SEQ, glm53_ct_pick
from tests.cpu_tier.host_producer import HostProducer, Outcome, debug_hold, expert_table
from tests.offload.test_host_store import PREFIX, _write_shard

SEED = int(os.environ.get("CPU_TIER_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
HIDDEN, INTER, K, EXPERTS, LAYERS = 256, 128, 3, 16, 2
LIMIT = 10.0
SHAPES = {"gate": (HIDDEN // 16, INTER // 16, 16 * K), "up": (HIDDEN // 16, INTER // 16, 16 * K),
          "down": (INTER // 16, HIDDEN // 16, 16 * K)}
RMS_OUT = {"gate": 6.0, "up": 6.0, "down": 1.0 / 8}  # gate/up RMS 6: the clamp at 10 bites on a few percent


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    """(store, table, experts[(row, e)] -> Linears) over a fresh random checkpoint."""
    print(f"seed {SEED} (CPU_TIER_TEST_SEED={SEED} repeats this run)")
    rng = np.random.default_rng(SEED)
    path = tmp_path_factory.mktemp("ckpt")
    tensors = {}
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            for proj, shape in SHAPES.items():
                tensors[f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}_proj.trellis"] = \
                    rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.int16)
    _write_shard(path / "model.safetensors", tensors)
    store = HostStore.scan(path)
    store.load(threads=2)
    sign_scale = {}
    for proj, (kin, kout, _) in SHAPES.items():
        n_in, n_out = kin * 16, kout * 16
        suh = rng.choice([-1.0, 1.0], (LAYERS, EXPERTS, n_in)) * rng.uniform(0.5, 1.5, (LAYERS, EXPERTS, n_in))
        svh = rng.choice([-1.0, 1.0], (LAYERS, EXPERTS, n_out)) * rng.uniform(0.5, 1.5, (LAYERS, EXPERTS, n_out)) \
            * RMS_OUT[proj] / (1.08 * np.sqrt(n_in))
        sign_scale[proj] = (suh.astype(np.float16), svh.astype(np.float16))
    table = expert_table(store, sign_scale)
    experts = {}
    for row in range(LAYERS):
        for e in range(EXPERTS):
            trellises = [tensors[f"{PREFIX}.{row}.mlp.experts.{e}.{p}_proj.trellis"] for p in ct.PROJECTIONS]
            experts[(row, e)] = tuple(ce.Linear(t, sign_scale[p][0][row, e], sign_scale[p][1][row, e])
                                      for t, p in zip(trellises, ct.PROJECTIONS))
    return store, table, experts


@pytest.fixture
def pool():
    with ce.Pool(threads=1, spin_us=100) as p:  # + the worker thread: the two cores of the CI machine
        yield p


def random_job(rng, tokens: int | None = None, picks: int | None = None):
    """(layer, x fp16 [T, hidden], picks [(t, e, w)]) with distinct experts per token, picks shuffled."""
    T = tokens or int(rng.integers(1, 9))
    out = []
    for t in range(T):
        k = picks or int(rng.integers(1, 9))
        for e in rng.choice(EXPERTS, k, replace=False):
            out.append((t, int(e), float(rng.uniform(0.01, 0.3))))
    rng.shuffle(out)
    x = rng.standard_normal((T, HIDDEN)).astype(np.float16)
    return int(rng.integers(0, LAYERS)), x, [tuple(p) for p in out]


def reference(experts, layer, x, picks, codebook: str = "fp16") -> np.ndarray:
    """kernel.expert_forward once per pick, one token at a time, in the documented sum order: the job's
    distinct experts in order of first appearance in the pick list, each added into a zeroed fp32 out."""
    out = np.zeros((x.shape[0], HIDDEN), np.float32)
    order = list(dict.fromkeys(e for _, e, _ in picks))
    for e in order:
        gate, up, down = experts[(layer, e)]
        for t, pe, w in picks:
            if pe == e:
                ce.expert_forward(x[t : t + 1], gate, up, down, np.array([w], np.float32), out[t : t + 1], act_limit=LIMIT,
                                  codebook=codebook)
    return out


def wait_for(predicate, timeout=5.0):
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.001)


def test_layout_is_aligned_and_documented():
    L = ct.ring_layout(slots=4, hidden=4096, max_tokens=8, max_picks=8)
    assert L.slots_offset == 256 and L.picks_offset == 128
    assert L.x_offset == 128 + 768  # 64 picks of 12 bytes, already a multiple of 128
    assert L.out_offset == L.x_offset + 2 * 8 * 4096
    assert L.slot_bytes == L.out_offset + 4 * 8 * 4096
    assert L.total_bytes == 256 + 4 * L.slot_bytes
    assert all(v % 128 == 0 for v in (L.slot_bytes, L.picks_offset, L.x_offset, L.out_offset))
    with pytest.raises(ce.KernelError, match="multiple of 128"):
        ct.ring_layout(4, 200)


@pytest.mark.parametrize("codebook", ["fp16", "int16"])  # the kernel's default, and the tier's
def test_jobs_of_1_to_8_tokens_and_picks_give_the_kernels_sum_bit_for_bit(tier, pool, codebook):
    _, table, experts = tier
    rng = np.random.default_rng([SEED, 1])
    ring = ct.Ring(slots=4, hidden=HIDDEN)
    producer = HostProducer(ring)
    jobs = [random_job(rng, tokens=t, picks=k) for t in (1, 8) for k in (1, 8)] + [random_job(rng) for _ in range(12)]
    with ct.Worker(ring, table, act_limit=LIMIT, pool=pool, codebook=codebook) as worker:
        for layer, x, picks in jobs:
            seq = producer.publish(layer, x, picks)
            assert producer.wait(seq, None) == Outcome("done")
            got = producer.result(seq)
            np.testing.assert_array_equal(got, reference(experts, layer, x, picks, codebook))
            assert np.abs(got).max() > 0
        c = worker.counters()
    assert (c["jobs"], c["done"], c["failed"]) == (len(jobs), len(jobs), 0)
    assert c["picks"] == sum(len(p) for _, _, p in jobs)
    assert c["tokens"] == sum(x.shape[0] for _, x, _ in jobs)
    assert c["experts"] == sum(len({e for _, e, _ in p}) for _, _, p in jobs)
    assert c["taken_back_before_claim"] == c["taken_back_after_claim"] == 0
    assert c["max_queue_depth"] == 1 and c["busy_s"] > 0


@pytest.mark.parametrize("bad", ["expert", "token", "duplicate"])
def test_an_invalid_job_fails_and_the_slot_is_reusable(tier, bad):
    _, table, _ = tier
    rng = np.random.default_rng([SEED, 2])
    ring = ct.Ring(slots=1, hidden=HIDDEN)
    producer = HostProducer(ring)
    layer, x, picks = random_job(rng, tokens=2, picks=2)
    wrong = {"expert": [(0, EXPERTS, 0.5)], "token": [(2, 0, 0.5)], "duplicate": [picks[0]]}[bad]
    with ct.Worker(ring, table, act_limit=LIMIT) as worker:
        seq = producer.publish(layer, x, picks + wrong)
        assert producer.wait(seq, None) == Outcome("failed")
        seq = producer.publish(layer, x, picks)
        assert producer.wait(seq, None) == Outcome("done")
        c = worker.counters()
    assert (c["jobs"], c["failed"], c["done"]) == (2, 1, 1)


def _payload_sum(picks, x, seq: int) -> int:
    """cpu_tier.h's SUM, written out: the payload's 32-bit words w_i (picks, then rows) summed as w_i * (2 i + 1), plus
    seq * GLM53_CT_SUM_SEQ, mod 2^64."""
    words = np.concatenate([np.array([(t, e, np.float32(w).view(np.int32)) for t, e, w in picks], np.int32).view(np.uint32).ravel(),
                            np.ascontiguousarray(x, np.float16).view(np.uint32).ravel()]).astype(object)
    return int((sum(int(w) * (2 * i + 1) for i, w in enumerate(words)) + seq * GLM53_CT_SUM_SEQ) % 2**64)


def test_the_payload_checksum_is_the_documented_sum_and_the_host_producer_writes_it():
    rng = np.random.default_rng([SEED, 21])
    layer, x, picks = random_job(rng, tokens=3, picks=4)
    arr = (glm53_ct_pick * len(picks))(*(glm53_ct_pick(t, e, w) for t, e, w in picks))
    got = library().glm53_ct_payload_sum(arr, len(picks), x.ctypes.data, x.shape[0], HIDDEN, 7)
    assert got == _payload_sum(picks, x, 7) != library().glm53_ct_payload_sum(arr, len(picks), x.ctypes.data, x.shape[0], HIDDEN, 8)
    ring = ct.Ring(slots=2, hidden=HIDDEN)
    assert HostProducer(ring).publish(layer, x, picks) == 1
    slot = ring.bytes[ring.layout.slots_offset + ring.layout.slot_bytes:]  # job 1 is in slot 1
    assert int(slot[GLM53_CT_SUM:GLM53_CT_SUM + 8].view(np.uint64)[0]) == _payload_sum(picks, x, 1)


def test_a_payload_that_does_not_match_its_checksum_is_read_again_then_failed_never_computed(tier):
    """A payload the worker reads before all of it has landed (as seen on the GPU host) must not be computed on: the
    worker reads it again for GLM53_CT_SUM_WAIT_US, then fails the job, which its producer computes itself."""
    _, table, _ = tier
    rng = np.random.default_rng([SEED, 22])
    ring = ct.Ring(slots=1, hidden=HIDDEN)
    producer = HostProducer(ring)
    layer, x, picks = random_job(rng, tokens=2, picks=3)
    seq = producer.publish(layer, x, picks)
    ring.x(0, 2)[1, 5] += np.float16(1.0)  # a row that differs from what the checksum covers
    with ct.Worker(ring, table, act_limit=LIMIT) as worker:
        assert producer.wait(seq, None) == Outcome("failed")
        seq = producer.publish(layer, x, picks)  # intact: computed at the first read
        assert producer.wait(seq, None) == Outcome("done")
        c = worker.counters()
    assert (c["jobs"], c["failed"], c["done"], c["payload_rereads"], c["payload_failed"]) == (2, 1, 1, 1, 1)


def test_many_jobs_through_few_slots_arrive_in_order_each_exactly_once(tier, pool):
    _, table, experts = tier
    rng = np.random.default_rng([SEED, 3])
    jobs = [random_job(rng, tokens=int(rng.integers(1, 5)), picks=int(rng.integers(1, 5))) for _ in range(150)]
    want = [reference(experts, *job) for job in jobs]
    ring = ct.Ring(slots=3, hidden=HIDDEN)
    producer = HostProducer(ring)
    failures: list[str] = []

    def produce():
        try:
            inflight: list[tuple[int, int]] = []  # (seq, job index)
            i = 0
            while i < len(jobs) or inflight:
                if i < len(jobs) and (seq := producer.publish(*jobs[i])) is not None:
                    inflight.append((seq, i))
                    i += 1
                    continue
                # a full ring: wait for the newest (then every older one must be done: claims are in order) or
                # the oldest job, alternately
                newest = len(inflight) > 1 and i % 2 == 0
                seq, j = inflight.pop(-1 if newest else 0)
                assert producer.wait(seq, None) == Outcome("done")
                if newest:
                    for s, _ in inflight:
                        assert ring.ack(s % 3) == (s, "done"), f"job {seq} done before job {s}"
                assert np.array_equal(producer.result(seq), want[j]), f"job {seq} has another job's result"
        except Exception as err:  # noqa: BLE001 - reported by the main thread
            failures.append(repr(err))

    with ct.Worker(ring, table, act_limit=LIMIT, pool=pool) as worker:
        thread = threading.Thread(target=produce)
        thread.start()
        thread.join(60)
        assert not thread.is_alive()
        c = worker.counters()
    assert not failures, failures[0]
    assert (c["jobs"], c["done"]) == (len(jobs), len(jobs))
    assert c["taken_back_before_claim"] == c["taken_back_after_claim"] == c["failed"] == 0
    assert 1 <= c["max_queue_depth"] <= 3
    assert ring.worker_next() == len(jobs) + 1


def test_random_deadlines_never_lose_nor_double_count_a_job(tier, pool):
    """Deadlines of 0 s to forever against a live worker: every job ends exactly once on the producer's side, as DONE
    (the right result) or taken back, and the worker reaches each once. The worker's counters can only bound the
    producer's outcomes: when a take-back and a completion cross, each side may see the other's word."""
    _, table, experts = tier
    rng = np.random.default_rng([SEED, 4])
    ring = ct.Ring(slots=2, hidden=HIDDEN)
    producer = HostProducer(ring)
    outcomes = {"done": 0, "before": 0, "after": 0}
    with ct.Worker(ring, table, act_limit=LIMIT, pool=pool, spin_us=100000) as worker:
        for _ in range(200):
            job = random_job(rng, tokens=int(rng.integers(1, 4)), picks=int(rng.integers(1, 4)))
            t0 = time.monotonic()
            while (seq := producer.publish(*job)) is None:  # a slot taken back after its claim comes back soon
                assert time.monotonic() - t0 < 5, f"slot of job {producer.next_seq} never came back"
            o = producer.wait(seq, [0.0, 20e-6, 200e-6, 2e-3, None][int(rng.integers(0, 5))])
            if o.state == "done":
                assert np.array_equal(producer.result(seq), reference(experts, *job))
            outcomes["done" if o.state == "done" else "after" if o.after_claim else "before"] += 1
        wait_for(lambda: ring.worker_next() == producer.next_seq)  # the worker reached (and counted) every job
        wait_for(lambda: all(ring.free(s) for s in range(2)))
        c = worker.counters()
    print("outcomes", outcomes, "worker", c)  # with -s
    assert sum(outcomes.values()) == 200
    assert c["jobs"] + c["taken_back_before_claim"] == 200  # the worker reached every job once
    assert c["jobs"] == c["done"] + c["taken_back_after_claim"] and c["failed"] == 0
    assert c["done"] >= outcomes["done"]  # every result the producer used, the worker computed
    assert c["taken_back_before_claim"] >= outcomes["before"]  # not seen claimed: the worker skipped it
    assert c["jobs"] <= outcomes["done"] + outcomes["after"]


def test_take_back_before_and_after_the_claim(tier):
    _, table, experts = tier
    rng = np.random.default_rng([SEED, 5])
    ring = ct.Ring(slots=1, hidden=HIDDEN)  # one slot: every job reuses it
    producer = HostProducer(ring)
    job1, job2, job3, job4 = (random_job(rng, tokens=3, picks=2) for _ in range(4))
    # before the claim: no worker yet
    s1 = producer.publish(*job1)
    assert producer.take_back(s1) == Outcome("taken_back", after_claim=False)
    assert ring.word(0) == (s1, "taken_back") and not ring.free(0)  # free once the worker has passed it
    with ct.Worker(ring, table, act_limit=LIMIT) as worker:
        wait_for(lambda: ring.ack(0) == (s1, "skipped"))
        s2 = producer.publish(*job2)
        assert producer.wait(s2, None) == Outcome("done")
        assert np.array_equal(producer.result(s2), reference(experts, *job2))
        c = worker.counters()
        assert (c["jobs"], c["taken_back_before_claim"], c["experts"]) == (1, 1, len({e for _, e, _ in job2[2]}))
        # after the claim: the worker holds the claimed job
        debug_hold(worker, True)
        s3 = producer.publish(*job3)
        wait_for(lambda: ring.ack(0) == (s3, "claimed"))
        assert producer.take_back(s3) == Outcome("taken_back", after_claim=True)
        assert ring.word(0) == (s3, "taken_back")
        assert producer.publish(*job4) is None  # not the producer's until the worker lets go
        debug_hold(worker, False)
        wait_for(lambda: ring.free(0))
        assert ring.ack(0) == (s3, "done")  # computed and published, but never used
        c = worker.counters()
        assert (c["jobs"], c["done"], c["taken_back_after_claim"]) == (2, 1, 1)
        s4 = producer.publish(*job4)  # reusable
        assert s4 == s3 + 1
        assert producer.wait(s4, None) == Outcome("done")
        assert np.array_equal(producer.result(s4), reference(experts, *job4))
        c = worker.counters()
    assert (c["jobs"], c["done"], c["taken_back_before_claim"], c["taken_back_after_claim"]) == (3, 2, 1, 1)


def test_stop_while_idle_returns_promptly(tier):
    _, table, _ = tier
    ring = ct.Ring(slots=2, hidden=HIDDEN)
    for spin_us in (0, 10_000_000):  # napping, and spinning
        worker = ct.Worker(ring, table, act_limit=LIMIT, spin_us=spin_us).start()
        time.sleep(0.05)
        t0 = time.monotonic()
        worker.stop()
        assert time.monotonic() - t0 < 0.2


def test_stop_while_busy_finishes_the_claimed_job_and_claims_no_other(tier, pool):
    _, table, experts = tier
    rng = np.random.default_rng([SEED, 6])
    ring = ct.Ring(slots=4, hidden=HIDDEN)
    producer = HostProducer(ring)
    jobs = [random_job(rng, tokens=8, picks=8) for _ in range(3)]
    worker = ct.Worker(ring, table, act_limit=LIMIT, pool=pool).start()
    debug_hold(worker, True)
    seqs = [producer.publish(*job) for job in jobs]
    wait_for(lambda: ring.ack(seqs[0] % 4) == (seqs[0], "claimed"))
    t0 = time.monotonic()
    worker.stop()
    assert time.monotonic() - t0 < 0.2
    assert [ring.ack(s % 4) for s in seqs] == [(seqs[0], "done"), (0, "empty"), (0, "empty")]  # nothing half-done
    assert [ring.word(s % 4) for s in seqs] == [(s, "published") for s in seqs]
    assert ring.worker_next() == seqs[1]
    with ct.Worker(ring, table, act_limit=LIMIT, pool=pool) as again:  # a new worker resumes where it stopped
        for seq, job in zip(seqs, jobs):
            assert producer.wait(seq, None) == Outcome("done")
            assert np.array_equal(producer.result(seq), reference(experts, *job))
        assert again.counters()["jobs"] == 2


def test_stop_under_a_stream_of_jobs_leaves_no_slot_claimed(tier, pool):
    _, table, _ = tier
    rng = np.random.default_rng([SEED, 7])
    ring = ct.Ring(slots=3, hidden=HIDDEN)
    producer = HostProducer(ring)
    worker = ct.Worker(ring, table, act_limit=LIMIT, pool=pool).start()
    stop = threading.Event()

    def produce():
        published = []
        while not stop.is_set():
            if (seq := producer.publish(*random_job(rng))) is not None:
                published.append(seq)
                continue
            time.sleep(0)
            for seq in [s for s in published if ring.ack(s % 3) == (s, "done")]:  # consume what is done
                producer.result(seq)
                published.remove(seq)

    thread = threading.Thread(target=produce)
    thread.start()
    wait_for(lambda: worker.counters()["done"] >= 5)
    t0 = time.monotonic()
    worker.stop()
    elapsed = time.monotonic() - t0
    stop.set()
    thread.join(5)
    assert elapsed < 0.2
    assert all(ring.ack(s)[1] in ("empty", "done") for s in range(3))  # none left claimed


def test_the_idle_worker_sleeps(tier, pool):
    _, table, _ = tier
    rng = np.random.default_rng([SEED, 8])
    ring = ct.Ring(slots=2, hidden=HIDDEN)
    producer = HostProducer(ring)
    with ct.Worker(ring, table, act_limit=LIMIT, pool=pool, spin_us=1000, nap_us=1000):
        seq = producer.publish(*random_job(rng))
        assert producer.wait(seq, None).state == "done"
        time.sleep(0.05)  # past the spin
        cpu0 = time.process_time()
        time.sleep(0.5)
        used = time.process_time() - cpu0
    assert used < 0.1, f"{used:.3f} s of CPU time in 0.5 s idle"


def test_a_table_with_wrong_dims_is_refused(tier):
    _, _, experts = tier
    ring = ct.Ring(slots=1, hidden=2 * HIDDEN)
    table = ct.ExpertTable({(0, 0): experts[(0, 0)]}, 1, 1)
    with pytest.raises(ce.KernelError, match="hidden 512"):
        ct.Worker(ring, table, act_limit=LIMIT).start()


def test_a_worker_woken_for_a_step_takes_no_nap_until_the_step_rests(tier):
    """Between wake() and rest() (a decode step in flight) the worker spins however long it waits: a job the GPU
    publishes then must not wait out a nap. After rest() it naps again once spin_us has passed; a step that never
    rests is taken as over a second after its wake-up."""
    _, table, _ = tier
    ring = ct.Ring(slots=2, hidden=HIDDEN)
    with ct.Worker(ring, table, act_limit=LIMIT, spin_us=100, nap_us=1000) as worker:
        wait_for(lambda: worker.counters()["naps"] > 0)  # idle: it naps
        for rests in (True, False):
            worker.wake()
            time.sleep(0.05)  # a nap under way at the wake-up ends (1 ms at most)
            naps = worker.counters()["naps"]
            time.sleep(0.2)  # 2,000 times spin_us
            assert worker.counters()["naps"] == naps
            if rests:
                worker.rest()
            wait_for(lambda: worker.counters()["naps"] > naps, timeout=3.0)


def test_an_idle_worker_parks_costs_no_cpu_and_a_wake_or_a_late_look_serves_the_next_job(tier):
    """Idle for park_us the worker parks (asleep on a futex); wake() (the engine calls it before every step) brings
    it back at once, and a job published without a wake is still served by its look at the ring every 100 ms."""
    _, table, experts = tier
    rng = np.random.default_rng([SEED, 9])
    ring = ct.Ring(slots=2, hidden=HIDDEN)
    producer = HostProducer(ring)
    with ct.Worker(ring, table, act_limit=LIMIT, spin_us=100, nap_us=1000, park_us=20_000) as worker:
        wait_for(worker.parked)

        def cpu_share(seconds: float) -> float:  # of one core, this whole process
            cpu0, wall0 = time.process_time(), time.monotonic()
            time.sleep(seconds)
            return (time.process_time() - cpu0) / (time.monotonic() - wall0)

        # the quieter of two windows: the parked worker's share, not a garbage collection or another test's
        # thread winding down (one window of 0.5 s once measured over 1 % on the 2-core CI machine)
        parked_cpu = min(cpu_share(0.5), cpu_share(0.5))
        assert worker.parked() and parked_cpu < 0.01  # well under 1 % of a core
        worker.wake()
        wait_for(lambda: not worker.parked())
        for woken in (True, False):
            wait_for(worker.parked)
            if woken:
                worker.wake()
            layer, x, picks = random_job(rng, tokens=1, picks=2)
            seq = producer.publish(layer, x, picks)
            assert producer.wait(seq, 2.0) == Outcome("done")  # unwoken: within its next look at the ring
            np.testing.assert_array_equal(producer.result(seq), reference(experts, layer, x, picks))
