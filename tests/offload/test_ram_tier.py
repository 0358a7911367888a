"""The RAM tier on real files (CPU): routing traces replayed through the VRAM cache's policy, the RAM tier and the
disk reader, every pick served from exactly one place with its bytes; the budget's limits; a failed read serving
nothing; and a budget that holds every expert changing nothing."""

from __future__ import annotations

import dataclasses
import errno

import numpy as np
import pytest

from glm53.offload.cache_policy import ReferenceCache, placement, popularity_lift
from glm53.offload.disk import SLOW, DiskReader, DiskReadError
from glm53.offload.host_store import HostStore
from glm53.offload.ram_tier import AHEAD_PIECE_BYTES, RamBudgetError, RamTier, TierPlan, TierPolicy, missed, plan
from tests.offload.test_disk import pieces_of, trellis_checkpoint

LAYERS, EXPERTS, TOP_K, ROWS = (1, 2, 3), 16, 2, 2
DECAY, HYSTERESIS, VRAM_MAX_ADMIT = 0.9, 1.25, 2
TIER = TierPolicy(decay=DECAY, hysteresis=HYSTERESIS, exclusive_after=2)  # fast: these traces are short
NO_VRAM = np.full(EXPERTS, -1, dtype=np.int32)  # a layer's VRAM residency with nothing in VRAM


def skewed(seed: int) -> tuple[np.ndarray, np.random.Generator]:
    """A routing profile with a few hot experts a layer, and the generator the trace is drawn with."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(1.0 / np.arange(1, EXPERTS + 1) ** 1.1) for _ in LAYERS]), rng


def trace(profile: np.ndarray, rng: np.random.Generator, steps: int) -> np.ndarray:
    """int [steps, layers, rows, top_k] picks drawn from the profile (distinct within a row, as a router's are)."""
    p = profile / profile.sum(axis=1, keepdims=True)
    return np.array([[[rng.choice(EXPERTS, TOP_K, replace=False, p=p[l]) for _ in range(ROWS)] for l in range(len(LAYERS))]
                     for _ in range(steps)])


def expected(store: HostStore, tensors: dict[str, bytes], layer: int, expert: int) -> list[bytes]:
    return [tensors[f"{store.layer_keys[layer]}.experts.{expert}.{p}_proj.trellis"] for p in ("gate", "up", "down")]


def projections(store: HostStore, block: np.ndarray) -> list[bytes]:
    return [block[off:off + n].tobytes() for off, n in zip(store.layout.offsets, store.layout.nbytes)]


class Hierarchy:
    """VRAM slots (the cache policy's reference, their bytes as arrays) over the RAM tier over the disk."""

    def __init__(self, store, tier: RamTier, profile, vram_slots: int):
        self.store, self.tier = store, tier
        self.given_up = 0  # policy slots the tier gave up while VRAM held their expert
        self.vram = ReferenceCache.warm(profile, vram_slots, TOP_K, DECAY)
        self.vram_bytes = [np.zeros(store.layout.block_bytes, np.uint8) for _ in range(vram_slots)]
        E = store.num_experts
        tier.read_into([(int(o) // E, int(o) % E) for o in self.vram.owner], self.vram_bytes)  # the cache's warm start
        self.sources = {"vram": 0, "ram": 0, "disk": 0}

    def step(self, layer: int, selected: np.ndarray) -> dict[int, tuple[str, np.ndarray]]:
        """One layer's decode step: where each picked expert is served from, and the bytes there."""
        vram = self.vram.slot_of[layer].copy()
        resident = vram >= 0
        picked = [int(e) for e in np.unique(selected)]
        hits = {e: int(self.vram.slot_of[layer, e]) for e in picked if resident[e]}
        admitted = self.vram.step(layer, selected, DECAY, HYSTERESIS, VRAM_MAX_ADMIT)
        missed = np.array([e for e in selected.reshape(-1) if not resident[e]], dtype=np.int64)
        in_ram = self.tier.policy.slot_of[layer] >= 0
        served = self.tier.step(layer, missed, vram)
        self.given_up += int((in_ram & resident & (self.tier.policy.slot_of[layer] < 0)).sum())
        out = {e: ("vram", self.vram_bytes[slot]) for e, slot in hits.items()}
        for where, experts in (("ram", served.ram), ("disk", served.disk)):
            for e in experts:
                assert e not in out, f"expert {e} of layer {layer} served twice"
                out[e] = (where, self.tier.block(layer, e))
        assert sorted(out) == picked
        for a in admitted:  # copied from where the tier holds it, as the cache's copy kernel does from its home
            self.vram_bytes[a.slot][:] = self.tier.block(layer, a.expert)
        for where, _ in out.values():
            self.sources[where] += 1
        return out


@pytest.fixture
def checkpoint(tmp_path):
    ckpt, tensors = trellis_checkpoint(tmp_path / "ckpt", layers=LAYERS, experts=EXPERTS, seed=5)
    store = HostStore.scan(ckpt)
    reader = DiskReader(store.shard_files(), threads=2)
    yield store, tensors, reader
    reader.close()


@pytest.mark.parametrize("seed, exclusive", [(0, True), (1, True), (0, False)])
def test_a_trace_through_vram_ram_and_disk_serves_every_pick_from_one_place_with_its_bytes(checkpoint, seed, exclusive):
    store, tensors, reader = checkpoint
    profile, rng = skewed(seed)
    block = store.layout.block_bytes
    vram_slots = 6
    tier_plan = plan(store, 24 * block)  # half of the 48 experts
    assert (tier_plan.policy_slots, tier_plan.window_slots) == (8, EXPERTS)
    tier = RamTier(store, reader, tier_plan)
    tier.start(profile, TOP_K, vram_slots, dataclasses.replace(TIER, exclusive=exclusive))
    assert reader.counters()["requests"] == 3 * 8  # three projections a block
    vram_placed = {(int(o) // EXPERTS, int(o) % EXPERTS) for o in ReferenceCache.warm(profile, vram_slots, TOP_K, DECAY).owner}
    ram_placed = {(int(o) // EXPERTS, int(o) % EXPERTS) for o in tier.policy.owner}
    assert not vram_placed & ram_placed  # the tier starts with the next-hottest, not what VRAM holds
    h = Hierarchy(store, tier, profile, vram_slots)
    loaded = reader.counters()["requests"]
    assert loaded == 3 * (8 + vram_slots)
    for step in trace(profile, rng, 40):
        for layer, selected in enumerate(step):
            for e, (where, got) in h.step(layer, selected).items():
                assert projections(store, got) == expected(store, tensors, layer, e), (where, layer, e)
    served = h.sources
    assert min(served.values()) > 20, served  # every level served (not vacuous)
    assert tier.reads["disk"] == served["disk"] and tier.reads["ram"] == served["ram"]
    assert reader.counters()["requests"] == loaded + 3 * served["disk"] and reader.counters()["failed"] == 0
    assert tier.reads["admitted"] > 0 and tier.verify() == []
    assert h.given_up > 0 or not exclusive  # exclusive: slots of experts VRAM held went to misses (not vacuous)
    assert tier.reads["given_up"] == h.given_up
    stats = tier.stats()
    decode = stats["decode"]  # the decode steps' host time, for bench.ram_tier_decode's breakdown
    assert decode["read_experts"] == served["disk"] and decode["read_seconds"] > 0 and decode["policy_seconds"] > 0
    assert stats["disk_files"] == reader.summary() and stats["disk_files"]["files"] == len(store.shard_files())


def test_with_ram_for_every_expert_there_is_no_tier_and_no_disk_read_after_load(checkpoint):
    store, tensors, reader = checkpoint
    assert plan(store, store.arena_bytes) is None  # the host store loads as today
    store.load()
    profile, rng = skewed(2)
    vram = ReferenceCache.warm(profile, 6, TOP_K, DECAY)
    for step in trace(profile, rng, 10):
        for layer, selected in enumerate(step):
            vram.step(layer, selected, DECAY, HYSTERESIS, VRAM_MAX_ADMIT)
            for e in np.unique(selected):
                assert projections(store, store.host_block(layer, int(e)).numpy()) == expected(store, tensors, layer, int(e))
    # a tier forced to hold every expert reads them once and never again
    full = RamTier(store, reader, TierPlan(len(LAYERS) * EXPERTS, EXPERTS, store.layout.block_bytes))
    full.start(profile, TOP_K, 0, TIER)
    after_load = reader.counters()
    for step in trace(profile, rng, 10):
        for layer, selected in enumerate(step):
            served = full.step(layer, selected, NO_VRAM)
            assert served.disk == [] and len(served.ram) == len(np.unique(selected))
    assert reader.counters() == after_load


def test_a_budget_below_one_layers_experts_is_refused_with_what_it_needs(checkpoint):
    store, _, _ = checkpoint
    block = store.layout.block_bytes
    with pytest.raises(RamBudgetError) as info:
        plan(store, 15 * block, what="GLM53_HOST_RAM_GB=0.0001")
    assert str(info.value) == (
        f"GLM53_HOST_RAM_GB=0.0001 gives {15 * block / 1e9:.2f} GB for routed experts, 15 blocks of {block / 1e6:.2f} MB; one MoE "
        f"layer's forward can pick all of its 16 experts (a prefill's does), which must be in RAM together: give at least "
        f"{16 * block / 1e9:.2f} GB (GLM53_HOST_RAM_GB), or free host memory")
    assert plan(store, 16 * block).policy_slots == 0  # the window alone: every miss read from disk
    assert plan(store, store.arena_bytes - 1).policy_slots == 2 * EXPERTS - 1  # a block short of the store: the rest, less the window


def test_a_failed_read_serves_nothing_and_the_expert_is_read_again_next_time(checkpoint):
    store, tensors, reader = checkpoint
    profile, _ = skewed(3)
    tier = RamTier(store, reader, plan(store, 20 * store.layout.block_bytes))
    tier.start(profile, TOP_K, 0, TIER)
    layer = 1
    cold = next(e for e in range(EXPERTS) if tier.policy.slot_of[layer, e] < 0)
    f, at, n, _ = store.block_sources(layer, cold)[2]
    reader.inject(store.shard_files().index(f), at + n // 2, errno.EIO, times=2)  # past the one retry
    picks = np.array([cold] * 8)  # picked often enough to be admitted
    owners, blocks = tier.policy.owner.copy(), tier.blocks.copy()
    with pytest.raises(DiskReadError, match=f"{f}: reading {n} bytes at byte {at} failed at byte .* with EIO"):
        tier.step(layer, picks, NO_VRAM)
    assert tier.block(layer, cold) is None and tier.policy.slot_of[layer, cold] < 0
    # the admission is undone: every slot keeps its expert, its block and its bytes (nothing was read into a slot)
    assert np.array_equal(tier.policy.owner, owners) and np.array_equal(tier.blocks, blocks) and tier.verify() == []
    victims = [int(o) % EXPERTS for o in owners if int(o) // EXPERTS == layer]
    served = tier.step(layer, np.array(victims), NO_VRAM)  # served from RAM: nothing read
    assert served.disk == [] and sorted(served.ram) == sorted(victims)
    served = tier.step(layer, picks, NO_VRAM)
    assert served.disk == [cold] and tier.policy.slot_of[layer, cold] >= 0  # admitted this time: its block took the slot
    assert projections(store, tier.block(layer, cold)) == expected(store, tensors, layer, cold)
    assert tier.verify() == []


def test_an_admitted_expert_takes_its_window_block_into_its_slot_and_the_slot_s_block_joins_the_window(checkpoint):
    store, tensors, reader = checkpoint
    profile, _ = skewed(5)
    tier = RamTier(store, reader, plan(store, 20 * store.layout.block_bytes))
    tier.start(profile, TOP_K, 0, TIER)
    layer, P = 0, tier.plan.policy_slots
    cold = next(e for e in range(EXPERTS) if tier.policy.slot_of[layer, e] < 0)
    window_block = int(tier.blocks[P + cold])
    requests = reader.counters()["requests"]
    tier.step(layer, np.array([cold] * 8), NO_VRAM)
    slot = int(tier.policy.slot_of[layer, cold])
    assert slot >= 0  # admitted
    victim_block = int(tier.blocks[P + cold])
    assert int(tier.blocks[slot]) == window_block and victim_block != window_block  # exchanged, not copied
    assert sorted(tier.blocks) == list(range(tier.plan.slots))  # still one role a block
    assert reader.counters()["requests"] == requests + 3  # its three projections, read once, into the window
    assert projections(store, tier.block(layer, cold)) == expected(store, tensors, layer, cold)
    assert tier.slot_index(layer, cold) == window_block and tier.verify() == []


def test_a_prefill_fetch_reads_what_no_policy_slot_holds_into_the_window_and_leaves_the_policy_alone(checkpoint):
    store, tensors, reader = checkpoint
    profile, _ = skewed(4)
    tier = RamTier(store, reader, plan(store, 24 * store.layout.block_bytes))
    tier.start(profile, TOP_K, 0, TIER)
    policy = (tier.policy.slot_of.copy(), tier.policy.freq.copy())
    layer = 2
    served = tier.fetch(layer, np.array([[3, 3, 15, 0], [7, 15, 1, 2]]))
    held = [e for e in (0, 1, 2, 3, 7, 15) if tier.policy.slot_of[layer, e] >= 0]
    assert sorted(served.ram) == held and sorted(served.disk) == sorted({0, 1, 2, 3, 7, 15} - set(held))
    for e in (0, 1, 2, 3, 7, 15):
        assert projections(store, tier.block(layer, e)) == expected(store, tensors, layer, e)
    before = reader.counters()["requests"]
    assert tier.fetch(layer, np.array([15, 3])).disk == []  # the window still holds the layer's: no read
    assert reader.counters()["requests"] == before
    assert tier.fetch(0, np.array([4])).disk in ([4], [])  # another layer's fetch takes the window over
    assert all(tier.block(layer, e) is None for e in served.disk)
    assert np.array_equal(policy[0], tier.policy.slot_of) and np.array_equal(policy[1], tier.policy.freq)


# the tier's first: never admitted
FIRST_POLICY = TierPolicy(decay=0.999, hysteresis=1.25, recency_weight=0.0, vram_score=0.0, exclusive=False)


@pytest.mark.parametrize("policy, admitted_by", [(TierPolicy(), 20), (FIRST_POLICY, None)])
def test_an_expert_that_recurs_among_the_misses_is_admitted(checkpoint, policy, admitted_by):
    store, tensors, reader = checkpoint
    profile, rng = skewed(6)
    vram_slots = 6
    tier = RamTier(store, reader, plan(store, 24 * store.layout.block_bytes))
    tier.start(profile, TOP_K, vram_slots, policy)
    layer = 0
    vram = {e for l, e in placement(profile, vram_slots) if l == layer}
    outside = [e for e in range(EXPERTS) if tier.policy.slot_of[layer, e] < 0 and e not in vram]  # misses, read from disk
    coldest = min(outside, key=lambda e: profile[layer, e])
    first_ram = None
    for t in range(60):  # the cold expert in every step, beside another miss drawn by the profile
        other = int(rng.choice([e for e in outside if e != coldest]))
        served = tier.step(layer, np.array([coldest, other]), NO_VRAM)
        if coldest in served.ram and first_ram is None:
            first_ram = t
    if admitted_by is None:
        assert first_ram is None and tier.reads["disk"] >= 60  # read from disk at every step
    else:
        assert first_ram is not None and first_ram <= admitted_by, first_ram
        assert projections(store, tier.block(layer, coldest)) == expected(store, tensors, layer, coldest)


@pytest.mark.parametrize("vram_score, admitted", [(1.0, True), (0.0, False)])
def test_an_expert_the_vram_cache_evicted_comes_with_its_popularity(checkpoint, vram_score, admitted):
    store, _, reader = checkpoint
    profile, _ = skewed(7)
    tier = RamTier(store, reader, plan(store, 24 * store.layout.block_bytes))
    tier.start(profile, TOP_K, 6, TierPolicy(vram_score=vram_score))
    layer, hot = placement(profile, 1)[0]  # the VRAM cache's hottest: it reaches the tier only once evicted from VRAM
    assert tier.step(layer, np.array([hot]), NO_VRAM).disk == [hot]
    assert (tier.policy.slot_of[layer, hot] >= 0) == admitted and tier.reads["admitted"] == int(admitted)  # a policy slot


@pytest.mark.parametrize("exclusive", [True, False])
def test_the_slot_of_an_expert_vram_held_for_exclusive_after_steps_goes_first_to_a_miss(checkpoint, exclusive):
    store, tensors, reader = checkpoint
    profile, _ = skewed(4)
    tier = RamTier(store, reader, plan(store, 24 * store.layout.block_bytes))
    tier.start(profile, TOP_K, 0, TierPolicy(decay=DECAY, hysteresis=100.0, exclusive=exclusive, exclusive_after=3))
    layer = 1
    ours = tier.policy.residents(layer)
    held, other = ours[0], ours[1]  # VRAM holds both (copied from here, say); ``other`` only since the second step
    slot = int(tier.policy.slot_of[layer, held])
    cold = next(e for e in range(EXPERTS) if tier.policy.slot_of[layer, e] < 0)
    vram = NO_VRAM.copy()
    vram[held] = 0
    for step in range(3):
        if step == 1:
            vram[other] = 1
        served = tier.step(layer, np.array([cold]), vram)
        assert served.disk == [cold] and served.ram == []
        given = step == 2 and exclusive  # VRAM has held ``held`` for 3 steps of the layer: its slot goes first
        assert (tier.policy.slot_of[layer, cold] == slot) == given and (tier.slot_index(layer, held) < 0) == given
        assert tier.policy.vram_held[layer, held] == step + 1 and tier.policy.vram_held[layer, other] == step
    # ``other`` (2 steps) and the rest (not in VRAM) keep theirs: hysteresis 100
    assert tier.reads["admitted"] == tier.reads["given_up"] == int(exclusive)
    assert tier.policy.slot_of[layer, other] >= 0
    assert tier.slot_index(layer, held) == (-1 if exclusive else slot)
    assert projections(store, tier.block(layer, cold)) == expected(store, tensors, layer, cold) and tier.verify() == []
    vram[held] = -1  # VRAM evicted it: the count starts again, and it is read from disk when missed (exclusive: no slot)
    served = tier.step(layer, np.array([held]), vram)
    assert (served.disk, served.ram) == (([held], []) if exclusive else ([], [held]))
    assert tier.policy.vram_held[layer, held] == 0


@pytest.mark.parametrize("field, value, accepted", [
    ("decay", 0.0, "in (0, 1]"), ("decay", 1.5, "in (0, 1]"), ("decay", float("nan"), "in (0, 1]"),
    ("hysteresis", 0.9, "at least 1 and finite"), ("hysteresis", float("inf"), "at least 1 and finite"),
    ("recency_decay", 1.0, "in (0, 1)"), ("recency_weight", -1.0, "at least 0 and finite"),
    ("recency_keep", 1.0, "in [0, 1)"), ("vram_score", 1.5, "in [0, 1]"), ("vram_score", -0.1, "in [0, 1]"),
    ("exclusive", 1.0, "True or False"), ("exclusive_after", 0, "an int, at least 1"), ("exclusive_after", 2.0, "an int, at least 1"),
])
def test_a_tier_policy_out_of_range_is_refused_naming_the_field_and_the_value(field, value, accepted):
    with pytest.raises(ValueError) as info:
        TierPolicy(**{field: value})
    assert str(info.value) == f"TierPolicy.{field}={value!r} is not accepted: it must be {accepted}"
    assert TierPolicy(decay=1.0, hysteresis=1.0, recency_weight=0.0, recency_keep=0.0, vram_score=0.0).recency.weight == 0.0


def test_what_reaches_the_tier_keeps_the_rows_with_minus_one_where_vram_holds_the_expert():
    vram_slot_of = np.array([-1, 0, -1, 1])
    picks = np.array([[0, 1], [3, 2], [7, -1]])  # 7 and -1 are no expert
    assert missed(picks, vram_slot_of).tolist() == [[0, -1], [-1, 2], [-1, -1]]


def test_the_tiers_reuse_lift_is_measured_against_what_popularity_gives_the_picks_that_miss_vram():
    profile = np.array([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    state = TierPolicy().state(profile, top_k=1, vram_slots=1, policy_slots=1)  # VRAM holds expert 0 of layer 0
    # layer 0: experts 1 and 2 reach the tier in a quarter of the steps each: sum p^2 / sum p - sum p(1-p) / (3 - sum p)
    assert state.reuse[0].tolist() == pytest.approx([0.1, 0.1])
    assert state.reuse[1].tolist() == pytest.approx([popularity_lift(profile[1:], 1)[0]] * 2)  # nothing in VRAM
    assert state.freq[0, 0] == pytest.approx(0.5 / (1 - TierPolicy().decay))  # vram_score 1: its warm score


def test_a_guess_read_ahead_serves_its_pick_without_a_read_and_a_wrong_one_is_dropped(tmp_path):
    ckpt, tensors = trellis_checkpoint(tmp_path / "ckpt", layers=LAYERS, experts=EXPERTS, seed=5)
    store = HostStore.scan(ckpt)
    with DiskReader(store.shard_files(), threads=1) as reader:  # one thread: what is queued behind a slow read stays queued
        tier = RamTier(store, reader, plan(store, 22 * store.layout.block_bytes, ahead=2))
        assert (tier.plan.policy_slots, tier.plan.ahead_slots) == (4, 2)
        profile, _ = skewed(6)
        tier.start(profile, TOP_K, 0, TierPolicy(decay=DECAY, hysteresis=100.0))  # no admission: the window serves
        layer, P, E = 1, tier.plan.policy_slots, EXPERTS
        cold = [e for e in range(E) if tier.policy.slot_of[layer, e] < 0]
        right, wrong = cold[0], cold[1]
        f, at, _, _ = store.block_sources(layer, right)[0]
        reader.inject(store.shard_files().index(f), at, "slow")  # the right guess's first projection waits
        held = next(e for e in range(E) if tier.policy.slot_of[layer, e] >= 0)
        pieces = reader.counters()["pieces"]
        assert tier.read_ahead(layer, [held, right, wrong]) == 2  # a policy slot's expert is not read ahead
        ahead_block = int(tier.blocks[P + E])
        served = tier.step(layer, np.array([right]), NO_VRAM)
        assert served.disk == [right] and tier.reads["ahead_used"] == 1
        # the right guess's projections were read (each as the reader cuts it) and nothing else: the wrong
        # one's were dropped
        files, base = store.shard_files(), tier.block(layer, right).ctypes.data  # the block the guess was read into

        def cut(g, at, n, off):
            mem, grid = reader.dio_alignment(files.index(g))
            straight = reader.direct(files.index(g)) and (base + off + (-at) % grid) % mem == 0
            return pieces_of(at, n, grid, AHEAD_PIECE_BYTES, straight)

        right_pieces = sum(len(cut(*source)) for source in store.block_sources(layer, right))
        assert reader.counters()["pieces"] == pieces + right_pieces and reader.counters()["failed"] == 3
        assert int(tier.blocks[P + right]) == ahead_block and tier.slot_index(layer, right) == ahead_block
        assert projections(store, tier.block(layer, right)) == expected(store, tensors, layer, right)
        assert tier.block(layer, wrong) is None
        # a guess for another layer, or one met by a prefill's fetch, is dropped; the step reads as without it
        tier.read_ahead(layer + 1, [cold[2]])
        served = tier.step(layer, np.array([wrong]), NO_VRAM)
        assert served.disk == [wrong] and tier.reads["ahead_used"] == 1
        assert projections(store, tier.block(layer, wrong)) == expected(store, tensors, layer, wrong)
        assert sorted(tier.blocks) == list(range(tier.plan.slots)) and tier.verify() == []


@pytest.mark.parametrize("admitted", [False, True])
def test_a_guess_whose_read_fails_is_read_again_by_the_step_where_its_block_plays_its_role(checkpoint, admitted):
    """Not admitted, into its window entry; admitted, into its slot (which took the guess's block)."""
    store, tensors, reader = checkpoint
    tier = RamTier(store, reader, plan(store, 22 * store.layout.block_bytes, ahead=2))
    profile, _ = skewed(7)
    tier.start(profile, TOP_K, 0, TIER if admitted else TierPolicy(decay=DECAY, hysteresis=100.0))
    layer = 2
    e = next(x for x in range(EXPERTS) if tier.policy.slot_of[layer, x] < 0)
    f, at, n, _ = store.block_sources(layer, e)[1]
    reader.inject(store.shard_files().index(f), at + n // 2, errno.EIO, times=2)  # the guess's read fails for good
    tier.read_ahead(layer, [e])
    served = tier.step(layer, np.array([e] * (8 if admitted else 1)), NO_VRAM)  # no error: its own read succeeds
    assert served.disk == [e] and tier.reads["ahead"] == 1 and tier.reads["ahead_used"] == 0
    assert (tier.policy.slot_of[layer, e] >= 0) == admitted
    assert projections(store, tier.block(layer, e)) == expected(store, tensors, layer, e)
    assert sorted(tier.blocks) == list(range(tier.plan.slots)) and tier.verify() == []


def test_a_step_whose_guess_and_read_again_both_fail_gives_every_block_back(checkpoint):
    store, tensors, reader = checkpoint
    tier = RamTier(store, reader, plan(store, 22 * store.layout.block_bytes, ahead=2))
    profile, _ = skewed(7)
    tier.start(profile, TOP_K, 0, TIER)
    layer = 2
    cold = [x for x in range(EXPERTS) if tier.policy.slot_of[layer, x] < 0]
    e, other = cold[0], cold[1]
    f, at, n, _ = store.block_sources(layer, e)[1]
    reader.inject(store.shard_files().index(f), at + n // 2, errno.EIO, times=4)  # the guess's read and its own, retried
    tier.read_ahead(layer, [e, other])
    owners, blocks = tier.policy.owner.copy(), tier.blocks.copy()
    with pytest.raises(DiskReadError):
        tier.step(layer, np.array([e] * 8 + [other] * 8), NO_VRAM)  # both admitted, one of them covered by a guess
    # every exchange undone: the slots keep their experts, blocks and bytes; neither expert has a block here
    assert np.array_equal(tier.policy.owner, owners) and np.array_equal(tier.blocks, blocks) and tier.verify() == []
    assert tier.block(layer, e) is None and tier.block(layer, other) is None
    served = tier.step(layer, np.array([e] * 8 + [other] * 8), NO_VRAM)  # the fault spent: both read and served
    assert sorted(served.disk) == [e, other]
    for x in (e, other):
        assert projections(store, tier.block(layer, x)) == expected(store, tensors, layer, x)
    assert tier.verify() == []


def test_placed_runs_while_the_reads_are_in_flight_with_every_block_decided(checkpoint):
    """The caller points its tables while the disk reads (``placed``): then each missed expert's address is already
    the one it has after the step, and the reads have not all finished."""
    store, tensors, reader = checkpoint
    tier = RamTier(store, reader, plan(store, 20 * store.layout.block_bytes))
    tier.pin(lambda address, n: None, lambda address: None, lambda host: __import__("torch").from_numpy(tier.arena))
    profile, _ = skewed(5)
    tier.start(profile, TOP_K, 0, TIER)
    layer = 0
    cold = [x for x in range(EXPERTS) if tier.policy.slot_of[layer, x] < 0][:2]
    picks = np.array([cold[0]] * 8 + [cold[1]])  # cold[0] admitted (the layer's one slot), cold[1] read into the window
    f, at, _, _ = store.block_sources(layer, cold[1])[0]
    reader.inject(store.shard_files().index(f), at, SLOW)  # a read that lands 300 ms late
    seen = {}

    def placed():
        seen["addresses"] = {x: tier.address(layer, x) for x in cold}
        seen["finished"] = reader.counters()["requests"]

    before = reader.counters()["requests"]
    tier.step(layer, picks, NO_VRAM, placed=placed)
    assert seen["addresses"] == {x: tier.address(layer, x) for x in cold} and min(seen["addresses"].values()) >= 0
    assert seen["finished"] < before + 6 == reader.counters()["requests"]  # two experts' three projections each
    assert tier.policy.slot_of[layer, cold[0]] >= 0 > tier.policy.slot_of[layer, cold[1]]  # exchanged before the wait
    for x in cold:
        assert projections(store, tier.block(layer, x)) == expected(store, tensors, layer, x)


def test_a_write_back_takes_a_slot_given_up_first_else_beats_the_weakest_by_the_hysteresis_else_is_dropped():
    policy = TierPolicy(hysteresis=2.0, recency_weight=0.0, exclusive_after=2)
    state = policy.state(np.array([[5.0, 4.0, 3.0, 2.0, 1.0]]), 1, 0, 2)  # slots 0, 1: experts 0, 1
    state.freq[0] = [5.0, 4.0, 3.0, 2.0, 1.0]
    held = np.array([True, False, False, False, False])
    state.vram_held[0, 0] = 1  # VRAM holds 0, but not for 2 steps yet: no slot given up; 3 <= 2 x 4
    assert policy.write_back(state, 0, 2, held, []) is None and state.residents(0) == [0, 1]
    state.vram_held[0, 0] = 2  # now 0's slot goes first, to any expert
    assert policy.write_back(state, 0, 4, held, []) == (4, 0, 0) and state.owner.tolist() == [4, 1]
    # then by the hysteresis: 3 <= 2 x 4 (expert 1) while 4, the weakest, was read in the step; then 3 > 2 x 1 (expert 4)
    assert policy.write_back(state, 0, 2, held, [4]) is None
    assert policy.write_back(state, 0, 2, held, []) == (2, 0, 4) and state.owner.tolist() == [2, 1]
    assert policy.write_back(state, 0, 2, held, []) is None  # a slot holds it already
