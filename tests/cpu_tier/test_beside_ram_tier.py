"""Fast mode's CPU tier beside a RAM tier, on the CPU: a real RAM tier over real files, its part in the offload
(``offload.tiered.TieredHome``) over a VRAM cache stand-in, and a real worker whose table starts at each expert's
``home`` in the tier's arena (``worker.ArenaExperts``) and follows each move of the part (``on_rehome`` ->
``Worker.repoint``). Through decode steps whose picks are read from disk into the window, admitted into policy
slots and given up again, every job the worker computes equals the kernel's sum over the checkpoint's own tensors,
bit for bit; without the re-pointing it does not (the test can fail)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.cpu_tier import kernel as ce
from glm53.cpu_tier import worker as ct
from glm53.offload.disk import DiskReader
from glm53.offload.host_store import HostStore
from glm53.offload.ram_tier import RamTier, plan
from glm53.offload.tiered import TieredHome
from tests.cpu_tier.host_producer import HostProducer, Outcome
from tests.cpu_tier.test_worker import HIDDEN, LIMIT, RMS_OUT, SHAPES, reference
from tests.offload.test_host_store import PREFIX, _write_shard
from tests.offload.test_ram_tier import EXPERTS, LAYERS, TIER, TOP_K, skewed, trace
from tests.offload.test_tiered import DECAY, HYSTERESIS, HostCache

POLICY_SLOTS = 10  # of 48 experts; VRAM holds 6 (HostCache), so most picks are read from disk


@pytest.fixture
def beside(tmp_path):
    """(tier, cache stand-in, part, the checkpoint's experts as Linears, sign/scale, profile, rng, reader)."""
    rng = np.random.default_rng(5)
    tensors = {f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}_proj.trellis": rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.int16)
               for layer in LAYERS for e in range(EXPERTS) for proj, shape in SHAPES.items()}
    names = list(tensors)
    (tmp_path / "ckpt").mkdir()
    _write_shard(tmp_path / "ckpt" / "a.safetensors", {n: tensors[n] for n in names[: len(names) // 2 + 1]})
    _write_shard(tmp_path / "ckpt" / "b.safetensors", {n: tensors[n] for n in names[len(names) // 2 + 1:]})
    store = HostStore.scan(tmp_path / "ckpt")
    L, E = store.num_layers, store.num_experts
    sign_scale = {}
    for proj, (kin, kout, _) in SHAPES.items():
        n_in, n_out = kin * 16, kout * 16
        suh = rng.choice([-1.0, 1.0], (L, E, n_in)) * rng.uniform(0.5, 1.5, (L, E, n_in))
        svh = rng.choice([-1.0, 1.0], (L, E, n_out)) * rng.uniform(0.5, 1.5, (L, E, n_out)) * RMS_OUT[proj] / (1.08 * np.sqrt(n_in))
        sign_scale[proj] = (suh.astype(np.float16), svh.astype(np.float16))
    own = {(row, e): tuple(ce.Linear(tensors[f"{key}.experts.{e}.{p}_proj.trellis"], sign_scale[p][0][row, e], sign_scale[p][1][row, e])
                           for p in ct.PROJECTIONS)
           for row, key in enumerate(store.layer_keys) for e in range(E)}
    reader = DiskReader(store.shard_files(), threads=2)
    tier = RamTier(store, reader, plan(store, (POLICY_SLOTS + E) * store.layout.block_bytes))
    arena = tier.pin(lambda address, n: None, lambda address: None, lambda host: host)  # device addresses = host ones
    profile, trace_rng = skewed(3)
    tier.start(profile, TOP_K, 6, TIER)
    cache = HostCache(store, profile, arena.data_ptr() + tier.plan.policy_slots * store.layout.block_bytes)
    home = TieredHome(tier, cache, torch.device("cpu"), max_picks=64)
    yield tier, cache, home, own, sign_scale, profile, trace_rng, arena
    reader.close()


def run_steps(beside, follow: bool, steps: int = 24) -> tuple[int, int, int]:
    """Decode steps through the part, the worker computing each layer's picks not in VRAM: (jobs, jobs equal to the
    reference, experts re-pointed)."""
    tier, cache, home, own, sign_scale, profile, rng, arena = beside
    store = tier.store
    arena_experts = ct.ArenaExperts(store, tier, cache.home_host, sign_scale)
    table = ct.ExpertTable(arena_experts.experts, store.num_layers, store.num_experts)
    ring = ct.Ring(slots=4, hidden=HIDDEN)
    producer = HostProducer(ring)
    moved = []
    jobs = equal = 0
    with ct.Worker(ring, table, act_limit=LIMIT) as worker:
        if follow:  # what FastTier.repoint does
            home.on_rehome.append(lambda row, experts, addresses: (worker.repoint(row, experts, arena_experts.trellises(addresses)),
                                                                   moved.append(len(experts))))
        for step in trace(profile, rng, steps):
            for layer, selected in enumerate(step):
                picks = selected.reshape(-1).astype(np.int64)
                vram = cache.policy.slot_of[layer].copy()
                home.resolve(layer, picks, vram, decode=True)
                cpu = [(t, int(e), 0.25 + 0.05 * k) for t, row in enumerate(selected) for k, e in enumerate(row) if vram[e] < 0]
                if cpu:
                    x = rng.standard_normal((selected.shape[0], HIDDEN)).astype(np.float16)
                    seq = producer.publish(layer, x, cpu)
                    assert producer.wait(seq, None) == Outcome("done")
                    jobs += 1
                    equal += np.array_equal(producer.result(seq), reference(own, layer, x, cpu))
                for a in cache.policy.step(layer, picks, DECAY, HYSTERESIS, 2):  # the VRAM cache's step, after the part
                    cache.slots[a.slot][:] = arena.numpy()[cache.home_host[layer, a.expert] - arena.data_ptr():][:store.layout.block_bytes]
                    cache.table[layer, a.evicted] = cache.home_host[layer, a.evicted]
    return jobs, equal, sum(moved)


def test_every_job_reads_its_experts_where_the_ram_tier_put_them(beside):
    jobs, equal, moved = run_steps(beside, follow=True)
    tier = beside[0]
    assert tier.reads["disk"] > 0 and tier.reads["ram"] > 0 and tier.reads["admitted"] > 0  # the moves this covers
    assert jobs > 50 and moved > 0
    assert equal == jobs


def test_without_following_the_moves_jobs_read_the_wrong_bytes(beside):
    jobs, equal, moved = run_steps(beside, follow=False)
    assert moved == 0 and jobs > 50 and equal < jobs


def test_a_repoint_of_an_unregistered_expert_or_to_no_address_is_refused_and_changes_nothing(beside):
    tier, cache, _, own, sign_scale, _, _, _ = beside
    store = tier.store
    arena_experts = ct.ArenaExperts(store, tier, cache.home_host, sign_scale)
    registered = {key: lins for key, lins in arena_experts.experts.items() if key != (0, 1)}
    ring = ct.Ring(slots=4, hidden=HIDDEN)
    producer = HostProducer(ring)
    held = int(np.setdiff1d(np.flatnonzero(tier.policy.slot_of[0] >= 0), [1])[0])  # an expert of layer 0 a policy slot holds
    slot = int(tier.policy.slot_of[0, held])
    with ct.Worker(ring, ct.ExpertTable(registered, store.num_layers, store.num_experts), act_limit=LIMIT) as worker:
        at = tier.block_address(tier.blocks[slot])
        good = arena_experts.trellises(np.array([at]))
        with pytest.raises(ce.KernelError, match="entry 1 is not a registered expert"):
            worker.repoint(0, np.array([held, 1]), np.concatenate([good, good]))
        with pytest.raises(ce.KernelError, match="NULL trellis"):
            worker.repoint(0, np.array([held]), np.zeros((1, 3), np.int64))
        with pytest.raises(ValueError, match="need 6 trellis addresses"):
            worker.repoint(0, np.array([held, 2]), good)
        x = np.ones((1, HIDDEN), np.float16)
        seq = producer.publish(0, x, [(0, held, 0.5)])  # still where it was registered (its window entry): not its bytes
        assert producer.wait(seq, None) == Outcome("done")
        assert not np.array_equal(producer.result(seq), reference(own, 0, x, [(0, held, 0.5)]))
        worker.repoint(0, np.array([held]), good)  # now its policy slot: its bytes
        seq = producer.publish(0, x, [(0, held, 0.5)])
        assert producer.wait(seq, None) == Outcome("done")
        np.testing.assert_array_equal(producer.result(seq), reference(own, 0, x, [(0, held, 0.5)]))
