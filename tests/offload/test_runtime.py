"""The running offload's hooks (glm53.offload.runtime.Offload) with stand-ins for its parts (the cache, prefetch, the
CPU tier) and the stager, on the CPU: each hook calls the parts that implement it in their order (decode steps go to
prefetch, the cache and then the tier), a large forward starts staging and borrows only what staging lacks, the next
small forward gives everything back, and close takes the hooks off before it stops the parts and unpins."""

from __future__ import annotations

import types

import torch

from glm53 import config
from glm53.offload import runtime
from glm53.offload.cache import Policy
from glm53.offload.link import Link
from glm53.offload.part import Part
from glm53.offload.runtime import STAGE_MIN_ROWS, Offload

GB = 1000**3


class Cache(Part):
    name = "cache"
    link, state, block_bytes = Link(None, torch.device("cpu")), None, 768

    def __init__(self, log):
        self.log, self.lent = log, False

    def routed(self, row, selected, weights, z):
        self.log.append(("cache", row, selected.shape[0]))

    def stats(self):
        return {"hits": 1}

    def lend(self, nbytes):
        self.log.append(("lend", nbytes))
        self.lent = True

    def restore(self):
        self.log.append("restore")
        self.lent = False

    def learned_profile(self):
        return torch.zeros(1)


class Stager:
    enabled, active = True, False

    def __init__(self, log, want):
        self.log, self.want = log, want

    def wanted_bytes(self):
        return self.want

    def begin(self, headroom):
        self.log.append(("stage", headroom))

    def release(self):
        self.log.append("release")

    def stats(self):
        return {}


class Tier(Part):
    name = "cpu_tier"

    def __init__(self, log):
        self.log = log

    def before_step(self):
        self.log.append("tier before")

    def routed(self, row, selected, weights, z):
        self.log.append(("tier", row, weights, z))

    def routed_sum(self, row, routed_sum):
        routed_sum += 1
        self.log.append(("sum", row))

    def after_step(self):
        self.log.append("tier after")

    def stats(self):
        return {"split": "stats"}

    def close(self):
        self.log.append("tier closed")


class Prefetch(Part):
    name = "prefetch"

    def __init__(self, log):
        self.log = log

    def forward_start(self):
        self.log.append("settle")

    def decode_start(self, rows):
        self.log.append(("lead", rows))

    def routed(self, row, selected, weights, z):
        self.log.append(("prefetch", row, z))

    def after_layer(self, row):
        self.log.append(("next", row))


def offload(tmp_path, log, headroom, want, *parts):
    settings = config.load(["-m", str(tmp_path), "--ec-elastic-gb", "1"], {})
    store = types.SimpleNamespace(unpin=lambda unregister: log.append(("unpin", unregister is runtime.cuda_unregister)),
                                  describe=lambda: "store")
    cache = Cache(log)
    o = Offload(settings, store, cache, Stager(log, want), device=torch.device("cpu"), policy=Policy(), vram={},
                profile_source="none", timings={}, parts=[p(log) if isinstance(p, type) else p for p in parts] or [cache])
    o._vram_headroom = lambda: headroom[0]
    return o


def test_decode_steps_go_to_the_cache_then_the_cpu_tier_and_prefill_steps_to_neither(tmp_path):
    log = []
    o = offload(tmp_path, log, [0], 0)
    o._attach((o.cache, Tier(log)))
    o.routed(1, torch.zeros((4, 8), dtype=torch.int64), "w", "z")
    o.routed(0, torch.zeros((Policy().decode_rows + 1, 8), dtype=torch.int64), "w", "z")  # more rows than a decode step
    assert log == [("cache", 1, 4), ("tier", 1, "w", "z")]
    log.clear()
    o.prefilling = True
    o.routed(1, torch.zeros((1, 8), dtype=torch.int64))
    assert log == []


def test_each_hook_calls_only_the_parts_that_implement_it(tmp_path):
    log = []
    o = offload(tmp_path, log, [0], 0)
    tier = Tier(log)
    o._attach((o.cache, tier))
    assert o.hooks("routed") == (o.cache, tier) and o.hooks("routed_sum") == (tier,) and o.hooks("after_layer") == ()
    assert o.tier is tier and o.prefetch is None
    o.before_step()
    routed = torch.zeros(3)
    assert o.routed_sum(2, routed) is routed and bool((routed == 1).all())  # added to in place
    o.after_step()
    assert log == ["tier before", ("sum", 2), "tier after"]
    stats = o.stats()
    assert stats["cpu_tier"] == {"split": "stats"} and stats["cache"] == {"hits": 1, "profile": "none"}
    with o.detached(tier):  # a measurement tool's run without it
        assert o.tier is None and o.hooks("routed") == (o.cache,)
        o.before_step()
    assert o.tier is tier and len(log) == 3


def test_a_decode_step_waits_for_its_prefetch_before_the_cache_and_every_layer_ends_with_the_prefetchs_turn(tmp_path):
    log = []
    o = offload(tmp_path, log, [0], 0)
    o._attach((Prefetch(log), o.cache))
    o.forward_start(1)
    assert log == ["settle", ("lead", 1)]  # every forward starts with no plan in flight; a decode one with its lead
    log.clear()
    o.forward_start(STAGE_MIN_ROWS)
    assert "settle" in log and not any(isinstance(e, tuple) and e[0] == "lead" for e in log)  # a prefill has none
    o.forward_start(1)  # the decode after it: the tables are back before the lead is planned
    assert log[-1] == ("lead", 1) and not o.prefilling
    log.clear()
    o.routed(1, torch.zeros((4, 8), dtype=torch.int64), "w", "z")
    o.after_layer(1)
    assert log == [("prefetch", 1, "z"), ("cache", 1, 4), ("next", 1)]
    log.clear()
    o.prefilling = True
    o.routed(1, torch.zeros((1, 8), dtype=torch.int64), "w", "z")
    o.after_layer(1)  # a prefill's layers end too: the prefetcher ignores layers whose routing it did not see
    assert log == [("next", 1)]


def test_a_large_forward_borrows_only_what_staging_lacks_and_the_next_small_one_gives_it_back(tmp_path):
    log = []
    headroom = [int(0.25 * GB)]
    o = offload(tmp_path, log, headroom, want=int(0.5 * GB))

    def lend(nbytes):
        log.append(("lend", nbytes))
        o.cache.lent = True
        headroom[0] += nbytes

    o.cache.lend = lend
    o.forward_start(STAGE_MIN_ROWS)
    assert log == [("lend", int(0.25 * GB)), ("stage", int(0.5 * GB))] and o.prefilling
    o.forward_start(STAGE_MIN_ROWS)  # already lent: not again
    assert log[-1] == ("stage", int(0.5 * GB)) and len(log) == 3
    o.forward_start(1)
    assert log[-2:] == ["release", "restore"] and not o.prefilling and not o.cache.lent
    o.forward_start(1)  # nothing to give back
    assert len(log) == 5


def test_close_takes_the_hooks_off_last_first_then_stops_the_tier_and_unpins(tmp_path, monkeypatch):
    log = []
    monkeypatch.setattr(runtime.torch.cuda, "synchronize", lambda device: log.append("sync"))
    o = offload(tmp_path, log, [0], 0)
    o._attach((o.cache, Tier(log)))
    o.removers += [lambda: log.append("hook 1"), lambda: log.append("hook 2")]
    o.close()
    assert log == ["hook 2", "hook 1", "tier closed", "release", "sync", ("unpin", True)]
    assert o.tier is None and o.parts == () and o.cache is None and o.removers == []
