"""Prefill staging beside the RAM tier, on the CPU over real files: what a forward stages (``staging.layer_staging``:
disk reads first, policy-slot experts with the room left, the overflow only from RAM) and the feed that reads each
layer's disk experts into the window a layer ahead (``tier_feed.TierFeed``): in order, never over a layer whose
copies are not done, a failed read failing its layer and every later one, and a stop that ends it mid-forward."""

from __future__ import annotations

import errno
import threading

import numpy as np
import pytest

from glm53.offload.disk import DiskReader, DiskReadError
from glm53.offload.host_store import HostStore
from glm53.offload.ram_tier import RamTier, plan
from glm53.offload.staging import layer_staging
from glm53.offload.tier_feed import TierFeed
from tests.offload.test_disk import trellis_checkpoint
from tests.offload.test_ram_tier import EXPERTS, LAYERS, TIER, TOP_K, expected, projections, skewed


class Copies:
    """A copy stream's event, done when the test says so."""

    def __init__(self):
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(10), "the copies never finished"


@pytest.fixture
def tier(tmp_path):
    ckpt, tensors = trellis_checkpoint(tmp_path / "ckpt", layers=LAYERS, experts=EXPERTS, seed=9)
    store = HostStore.scan(ckpt)
    reader = DiskReader(store.shard_files(), threads=2)
    tier = RamTier(store, reader, plan(store, 24 * store.layout.block_bytes))  # 8 policy slots + the window
    tier.start(skewed(2)[0], TOP_K, 0, TIER)
    yield store, tensors, tier, reader
    reader.close()


def vram(store: HostStore, held: dict[int, list[int]]) -> np.ndarray:
    resident = np.full((store.num_layers, store.num_experts), -1, dtype=np.int32)
    for slot, (layer, expert) in enumerate((l, e) for l, es in held.items() for e in es):
        resident[layer, expert] = slot
    return resident


def test_a_staged_forward_reads_from_disk_only_what_no_policy_slot_holds_and_stages_those_first(tier):
    store, _, tier, _ = tier
    resident = vram(store, {0: [0, 1], 2: [5]})
    tightest = max(len(r.disk) for r in layer_staging(resident, capacity=EXPERTS, tier=tier))
    capacity = tightest + 1
    rows = layer_staging(resident, capacity=capacity, tier=tier)
    for row, r in enumerate(rows):
        in_ram = {e for e in range(EXPERTS) if tier.policy.slot_of[row, e] >= 0}
        assert set(r.missing) == {e for e in range(EXPERTS) if resident[row, e] < 0}
        assert set(r.disk) == set(r.missing) - in_ram and len(r.disk) > 0
        assert list(r.staged[:len(r.disk)]) == list(r.disk)  # the window's experts first: it is overwritten next layer
        assert set(r.overflow) <= in_ram and len(r.staged) == min(capacity, len(r.missing))
        assert set(r.staged) | set(r.overflow) == set(r.missing) and not set(r.staged) & set(r.overflow)
        window = tier.plan.policy_slots
        for e, source in zip(r.staged, r.sources):
            assert source == (window + e if e in r.disk else tier.policy.slot_of[row, e])
        assert list(r.homes) == [tier.block_address(tier.blocks[window + e if e in r.disk else tier.policy.slot_of[row, e]]) for e in r.missing]
    assert any(len(r.overflow) for r in rows)  # the capacity binds somewhere (not vacuous)
    assert layer_staging(resident, capacity=tightest, tier=tier) is not None
    assert layer_staging(resident, capacity=tightest - 1, tier=tier) is None  # a layer's disk reads would not fit


def test_without_a_tier_the_missing_experts_are_staged_in_id_order_up_to_the_capacity(tier):
    store = tier[0]
    rows = layer_staging(vram(store, {1: [3]}), capacity=10)
    assert [list(r.staged) for r in rows][1] == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert list(rows[1].overflow) == [11, 12, 13, 14, 15] and list(rows[1].sources) == list(rows[1].staged)
    assert all(len(r.disk) == 0 for r in rows)


def test_the_feed_reads_each_layer_into_the_window_only_once_the_previous_layers_copies_are_done(tier):
    store, tensors, tier, reader = tier
    rows = layer_staging(vram(store, {}), capacity=EXPERTS, tier=tier)
    feed = TierFeed(tier, [r.disk for r in rows])
    try:
        copies = [Copies() for _ in rows]
        for row, r in enumerate(rows):
            feed.ready(row)
            for e in r.disk:
                assert tier.slot_index(row, int(e)) == tier.plan.policy_slots + e
                assert projections(store, tier.block(row, int(e))) == expected(store, tensors, row, int(e)), (row, e)
            requests = reader.counters()["requests"]
            feed.release(row, copies[row])
            assert not feed._done[row + 1].wait(0.2) if row + 1 < len(rows) else True  # waits for the copies
            assert reader.counters()["requests"] == requests
            copies[row].done.set()
    finally:
        feed.stop()
    assert feed.counters["layers"] == len(rows) and feed.counters["experts"] == sum(len(r.disk) for r in rows)


def test_a_failed_read_fails_its_layer_and_every_later_one_and_the_window_holds_none_of_it(tier):
    store, _, tier, reader = tier
    rows = layer_staging(vram(store, {}), capacity=EXPERTS, tier=tier)
    victim = int(rows[1].disk[0])
    f, at, n, _ = store.block_sources(1, victim)[0]
    reader.inject(store.shard_files().index(f), at, errno.EIO, times=2)  # past the one retry
    feed = TierFeed(tier, [r.disk for r in rows])
    done = Copies()
    done.done.set()
    try:
        feed.ready(0)
        feed.release(0, done)
        for row in (1, 2):
            with pytest.raises(DiskReadError, match=f"{f}: reading {n} bytes at byte {at}"):
                feed.ready(row)
    finally:
        feed.stop()
    assert tier.block(1, victim) is None and all(tier.block(1, int(e)) is None for e in rows[1].disk)


def test_a_stop_mid_forward_ends_the_feed_with_the_window_holding_the_last_layer_read(tier):
    store, tensors, tier, _ = tier
    rows = layer_staging(vram(store, {}), capacity=EXPERTS, tier=tier)
    feed = TierFeed(tier, [r.disk for r in rows])
    feed.ready(0)
    feed.stop()  # a forward that stopped after its first layer: no release
    assert not feed._thread.is_alive() and feed.counters["layers"] == 1
    e = int(rows[0].disk[0])
    assert projections(store, tier.block(0, e)) == expected(store, tensors, 0, e)
    assert tier.fetch(0, rows[0].disk).disk == []  # the tier knows the window holds them: a decode would not read again
