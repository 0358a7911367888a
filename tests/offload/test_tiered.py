"""The RAM tier's part in the running offload (glm53.offload.tiered), on the CPU: a VRAM cache stand-in in host memory
(the cache policy's reference, ``home`` and tables as the device keeps them) over a real RAM tier over real files.
Through decode steps and prefill forwards the part keeps its invariant: when a layer's experts run, every pick not
in VRAM has its table entry at a block holding its bytes, and the cache's admissions copy valid bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.offload.cache import Policy
from glm53.offload.cache_policy import ReferenceCache
from glm53.offload.disk import DiskReader
from glm53.offload.host_store import HostStore
from glm53.offload.ram_tier import RamTier, TierPolicy, plan
from glm53.offload.tiered import TieredHome
from tests.offload.test_disk import trellis_checkpoint
from tests.offload.test_ram_tier import EXPERTS, LAYERS, ROWS, TIER, TOP_K, expected, projections, skewed, trace

DECAY, HYSTERESIS, VRAM_SLOTS = 0.9, 1.25, 6
VRAM_POLICY = Policy(decay=DECAY, hysteresis=HYSTERESIS, max_admit=2, recency_weight=0.0)  # the stand-in's steps


class HostCache:
    """The expert cache's state as its kernels keep it, in host memory: VRAM slots by the reference policy, ``home``
    (a device address per expert: here the tier arena's host address) and a table entry per expert."""

    def __init__(self, store: HostStore, profile, home_base: int):
        self.store = store
        L, E = store.num_layers, store.num_experts
        self.policy = ReferenceCache.warm(profile, VRAM_SLOTS, TOP_K, DECAY)
        self.home = torch.full((L, E), home_base, dtype=torch.int64)
        self.home_host = self.home.numpy()
        self.table = self.home_host.copy()  # where the layer's kernels read each expert (-1: a VRAM slot)
        self.slots = [np.zeros(store.layout.block_bytes, np.uint8) for _ in range(VRAM_SLOTS)]
        self.assigned = 0

    def copy_out(self, slot, dest):
        dest.numpy()[:] = self.slots[slot]

    def assign(self, entries):
        for layer, expert, slot in entries:
            assert slot == -1 and self.policy.slot_of[layer, expert] < 0, "only non-residents are pointed home"
            self.table[layer, expert] = self.home_host[layer, expert]
            self.assigned += 1


@pytest.fixture
def hierarchy(tmp_path, request):
    """The tier over real files, with ``request.param`` ahead entries (indirect parametrisation; 0 by default)."""
    ckpt, tensors = trellis_checkpoint(tmp_path / "ckpt", layers=LAYERS, experts=EXPERTS, seed=7)
    store = HostStore.scan(ckpt)
    reader = DiskReader(store.shard_files(), threads=2)
    ahead = getattr(request, "param", 0)
    tier = RamTier(store, reader, plan(store, (24 + ahead) * store.layout.block_bytes, ahead=ahead))  # 8 policy slots
    arena = tier.pin(lambda address, n: None, lambda address: None, lambda host: host)  # device addresses = host ones
    profile, rng = skewed(11)
    tier.start(profile, TOP_K, VRAM_SLOTS, TIER)
    cache = HostCache(store, profile, arena.data_ptr() + tier.plan.policy_slots * store.layout.block_bytes)
    home = TieredHome(tier, cache, torch.device("cpu"), max_picks=64)
    yield store, tensors, tier, cache, home, profile, rng, arena
    reader.close()


def bytes_at(arena: torch.Tensor, address: int, store: HostStore) -> list[bytes]:
    at = address - arena.data_ptr()
    assert 0 <= at <= arena.numel() - store.layout.block_bytes, "the table points outside the tier's arena"
    return projections(store, arena.numpy()[at:at + store.layout.block_bytes])


@pytest.mark.parametrize("hierarchy", [0, 3], indirect=True, ids=["no-ahead", "ahead-3"])
@pytest.mark.parametrize("prefill_every", [0, 5])
@pytest.mark.parametrize("write_back", [False, True], ids=["", "write-back"])
def test_every_pick_not_in_vram_is_read_from_a_block_holding_its_bytes(hierarchy, prefill_every, write_back):
    """With reads ahead, each decode layer's step is followed by a guess of the next layer's picks (as ``place`` makes
    it, the router's): its true picks interleaved with wrong ones, so that some reads ahead are used and the others
    dropped. With the write-back, the part predicts each VRAM step's evictions from the layer's state (as read at the
    sync) and copies those the tier takes back from their VRAM slots: every prediction is the step's own, and an
    evicted expert's table then points at a block holding its bytes."""
    store, tensors, tier, cache, home, profile, rng, arena = hierarchy
    if write_back:
        home = TieredHome(tier, cache, torch.device("cpu"), max_picks=64, write_back=VRAM_POLICY)
    E = store.num_experts
    evictions = 0
    for pair, slot in zip([(int(o) // E, int(o) % E) for o in cache.policy.owner], cache.slots):  # the VRAM warm start
        tier.read_into([pair], [slot])
    for t, step in enumerate(trace(profile, rng, 30)):
        prefill = prefill_every and t % prefill_every == 0
        for layer, selected in enumerate(step):
            if tier.plan.ahead_slots and layer and not prefill:
                true = np.unique(selected.reshape(-1))
                wrong = rng.permutation(np.setdiff1d(np.arange(E), true))[:true.size]
                home.guess(layer, np.stack([true, wrong], axis=1).reshape(-1), cache.policy.slot_of[layer].copy())
            picks = (np.arange(E).repeat(2) if prefill else selected.reshape(-1)).astype(np.int64)
            vram = cache.policy.slot_of[layer].copy()
            state = cache.policy
            home.resolve(layer, picks, vram, decode=not prefill, vram_state=tuple(
                a[layer].copy() for a in (state.freq, state.recent, state.prev, state.reuse)) if write_back else None)
            for e in np.unique(picks):
                if vram[e] >= 0:
                    got = projections(store, cache.slots[vram[e]])
                else:
                    got = bytes_at(arena, int(cache.table[layer, e]), store)
                assert got == expected(store, tensors, layer, int(e)), (t, layer, int(e), prefill)
            if not prefill:  # the cache's step after the part: its admissions copy from home
                admissions = cache.policy.step(layer, picks, DECAY, HYSTERESIS, 2)
                evictions += len(admissions)
                for a in admissions:
                    cache.slots[a.slot][:] = arena.numpy()[cache.home_host[layer, a.expert] - arena.data_ptr():][:store.layout.block_bytes]
                    assert projections(store, cache.slots[a.slot]) == expected(store, tensors, layer, a.expert)
                    cache.table[layer, a.evicted] = cache.home_host[layer, a.evicted]  # the victim points home (maybe stale)
    counters = home.counters
    assert counters["decode_layers"] > 0 and (counters["other_layers"] > 0) == bool(prefill_every)
    assert counters["rewritten"] - counters["written_back"] == cache.assigned > 0  # written back: resident, no table
    if write_back:  # (this small tier's slots are busy or warmer: it takes few back; the next test makes it take one)
        assert counters["predicted_evictions"] == evictions > 0  # the host's prediction is the step's own
        assert counters["written_back"] == tier.reads["written_back"]
    assert tier.reads["disk"] > 0 and tier.reads["ram"] > 0 and tier.verify() == []
    assert sorted(tier.blocks) == list(range(tier.plan.slots))
    if tier.plan.ahead_slots:
        assert 0 < tier.reads["ahead_used"] < tier.reads["ahead"]
    else:
        assert tier.reads["ahead"] == 0


def test_a_step_whose_picks_are_all_in_vram_reads_nothing(hierarchy):
    store, _, tier, cache, home, _, _, _ = hierarchy
    layer = 0
    resident = np.flatnonzero(cache.policy.slot_of[layer] >= 0)
    assert resident.size
    before = tier.reader.counters()["requests"]
    home.resolve(layer, resident.astype(np.int64), cache.policy.slot_of[layer].copy(), decode=True)
    assert tier.reader.counters()["requests"] == before and cache.assigned == 0


def test_a_slot_given_up_while_vram_holds_its_expert_is_never_read_for_it_and_it_is_re_pointed_when_next_picked(hierarchy):
    """The tier gives up the slot of an expert VRAM holds, and VRAM evicts that expert in the same step: its table goes
    to its stale ``home`` (the slot's old block, which now plays the admitted expert's window entry), which nothing
    reads before its next pick re-points it."""
    store, tensors, tier, cache, home, profile, rng, arena = hierarchy
    E = store.num_experts
    tier.start(profile, TOP_K, VRAM_SLOTS, TierPolicy(decay=DECAY, hysteresis=100.0, exclusive_after=2))  # no other admission
    layer = int(cache.policy.owner[0]) // E  # a layer with a VRAM slot
    e = tier.policy.residents(layer)[0]
    slot = int(tier.policy.slot_of[layer, e])
    x = next(c for c in range(E) if tier.policy.slot_of[layer, c] < 0 and cache.policy.slot_of[layer, c] < 0)
    home.resolve(layer, np.array([e]), cache.policy.slot_of[layer].copy(), decode=True)  # served from its slot
    e_block = int(tier.blocks[slot])
    assert cache.home_host[layer, e] == cache.table[layer, e] == tier.block_address(e_block)
    # the VRAM cache admits e in place of one of its residents, copied from home, as its copy kernel does
    v = cache.policy.residents(layer)[0]
    vslot = int(cache.policy.slot_of[layer, v])
    cache.slots[vslot][:] = arena.numpy()[cache.home_host[layer, e] - arena.data_ptr():][:store.layout.block_bytes]
    cache.policy.slot_of[layer, v], cache.policy.slot_of[layer, e] = -1, vslot
    cache.table[layer, v], cache.table[layer, e] = cache.home_host[layer, v], -1
    for step in range(2):  # x is missed twice; at the second VRAM has held e for 2 steps and x takes e's slot
        home.resolve(layer, np.array([x]), cache.policy.slot_of[layer].copy(), decode=True)
        assert (tier.policy.slot_of[layer, x] == slot) == (step == 1)
    # x was read into its window entry's block, which its slot then took: the slot's old block plays x's window entry
    assert int(tier.blocks[slot]) != e_block and int(tier.blocks[tier.plan.policy_slots + x]) == e_block
    assert tier.address(layer, e) == -1 and cache.home_host[layer, x] == cache.table[layer, x] == tier.address(layer, x)
    assert bytes_at(arena, int(cache.table[layer, x]), store) == expected(store, tensors, layer, x)
    assert cache.home_host[layer, e] == tier.block_address(e_block)  # stale, but e is read from its VRAM slot
    assert projections(store, cache.slots[vslot]) == expected(store, tensors, layer, e)
    # the VRAM cache evicts e in the same step (it was not picked): its table goes home, to the block of a window entry
    # (e's bytes until that entry is read into), and nothing reads it
    cache.policy.slot_of[layer, e] = -1
    cache.table[layer, e] = cache.home_host[layer, e]
    disk = tier.reads["disk"]
    home.resolve(layer, np.array([e, x]), cache.policy.slot_of[layer].copy(), decode=True)  # e picked again
    assert tier.reads["disk"] == disk + 1 and cache.table[layer, e] == cache.home_host[layer, e] == tier.address(layer, e)
    assert bytes_at(arena, int(cache.table[layer, e]), store) == expected(store, tensors, layer, e)
    assert bytes_at(arena, int(cache.table[layer, x]), store) == expected(store, tensors, layer, x)


def test_an_expert_the_vram_cache_evicts_is_copied_into_the_slot_the_tier_gives_up_and_served_from_it_after(hierarchy):
    """A RAM slot whose expert VRAM has held long enough is given up first; the VRAM step about to evict a cold
    resident that no RAM slot holds: the part predicts it, the tier takes it into that slot, its VRAM bytes are copied
    there before the step, its ``home`` (not its table) points there, and after the step evicts it its next pick is
    served from RAM without a disk read."""
    store, tensors, tier, cache, _, profile, rng, arena = hierarchy
    home = TieredHome(tier, cache, torch.device("cpu"), max_picks=64, write_back=VRAM_POLICY)
    E, b = store.num_experts, store.layout.block_bytes
    for pair, slot in zip([(int(o) // E, int(o) % E) for o in cache.policy.owner], cache.slots):  # the VRAM warm start
        tier.read_into([pair], [slot])
    layer = next(l for l in range(store.num_layers) if (cache.policy.slot_of[l] >= 0).sum() >= 2 and tier.policy.residents(l))
    d = tier.policy.residents(layer)[0]  # its RAM slot goes first: VRAM holds d too, for exclusive_after steps
    v = next(e for e in cache.policy.residents(layer) if tier.policy.slot_of[layer, e] < 0 and e != d)  # the VRAM victim
    c = next(e for e in range(E) if cache.policy.slot_of[layer, e] < 0 and tier.policy.slot_of[layer, e] < 0 and e != d)
    if cache.policy.slot_of[layer, d] < 0:  # VRAM takes d in place of another resident (as its copy kernel would)
        w = next(e for e in cache.policy.residents(layer) if e != v)
        wslot = int(cache.policy.slot_of[layer, w])
        cache.slots[wslot][:] = tier.block(layer, d)
        cache.policy.slot_of[layer, w], cache.policy.slot_of[layer, d] = -1, wslot
        cache.table[layer, w], cache.table[layer, d] = cache.home_host[layer, w], -1
    tier.policy.vram_held[layer, d] = tier.parameters.exclusive_after - 1  # the step counts one more
    cache.policy.freq[layer, v], cache.policy.freq[layer, c] = 0.01, 100.0  # the step admits c in v's place
    d_slot = int(tier.policy.slot_of[layer, d])
    v_vram, v_table = int(cache.policy.slot_of[layer, v]), int(cache.table[layer, v])
    vram = cache.policy.slot_of[layer].copy()
    state = cache.policy
    home.resolve(layer, np.array([c]), vram, decode=True,
                 vram_state=tuple(a[layer].copy() for a in (state.freq, state.recent, state.prev, state.reuse)))
    # d's slot went first, to the step's miss c or to v; v has a slot, its VRAM bytes copied into that slot's block
    assert home.counters["written_back"] == tier.reads["written_back"] == 1
    assert tier.policy.slot_of[layer, d] < 0 and tier.address(layer, d) == -1 and d_slot in tier.policy.slot_of[layer, [c, v]]
    v_block = int(tier.blocks[tier.policy.slot_of[layer, v]])
    assert cache.home_host[layer, v] == tier.block_address(v_block) and cache.table[layer, v] == v_table  # the table: not moved
    assert projections(store, arena.numpy()[v_block * b:(v_block + 1) * b]) == expected(store, tensors, layer, v)
    # the VRAM step: c admitted in v's slot (copied from c's home), v's table goes home, to its RAM slot
    (a,) = cache.policy.step(layer, np.array([c]), DECAY, HYSTERESIS, 2)
    assert (a.expert, a.slot, a.evicted) == (c, v_vram, v)
    cache.slots[a.slot][:] = arena.numpy()[cache.home_host[layer, c] - arena.data_ptr():][:b]
    cache.table[layer, v] = cache.home_host[layer, v]
    disk = tier.reads["disk"]
    home.resolve(layer, np.array([v]), cache.policy.slot_of[layer].copy(), decode=True)
    assert tier.reads["disk"] == disk  # served from RAM: the write-back saved its read
    assert bytes_at(arena, int(cache.table[layer, v]), store) == expected(store, tensors, layer, v)
    assert tier.verify() == []


@pytest.mark.parametrize("hierarchy", [2], indirect=True)
def test_a_layer_whose_guesses_go_unused_stops_reading_ahead_for_a_while(hierarchy):
    store, _, tier, cache, _, profile, rng, _ = hierarchy
    home = TieredHome(tier, cache, torch.device("cpu"), max_picks=64, routers=[None] * store.num_layers)  # guessed by hand here
    E, layer = store.num_experts, 1
    for forward in range(200):
        home.decode_start(1)
        vram = cache.policy.slot_of[layer].copy()
        cold = [e for e in range(E) if vram[e] < 0 and tier.policy.slot_of[layer, e] < 0]
        pick, wrong = cold[0], cold[-1]
        home.guess(layer, np.array([wrong]), vram)  # always wrong
        home.resolve(layer, np.array([pick]), vram, decode=True)
        if forward == 40:
            assert home.gate.counts["closed"] == 1 and tier.reads["ahead"] == home.gate.window  # closed after 32 guesses
    gate = home.gate.stats()
    assert gate["closed"] >= 2 and gate["reopened"] >= 1 and tier.reads["ahead_used"] == 0
    assert tier.reads["ahead"] < 200 // 2  # resting most of the time
    assert home.stats()["ahead_gate"]["min_precision"] == 0.3
