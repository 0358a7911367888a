"""The offload's start (glm53.engine.exl3.offload.start_offload) with stand-ins for every step, on the CPU: the
steps run in the order its docstring gives, each handed what the one before made, and the CPU tier only in fast
mode. The real start runs on the GPU (tests/gpu/test_offload_exact.py, test_fast_tier.py)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from glm53 import config
from glm53.engine.exl3 import offload as start
from glm53.engine.exl3.patches import MoeLayers
from glm53.offload.cache import Policy
from glm53.offload.part import Part
from glm53.offload.ram_tier import TierPolicy
from glm53.offload.runtime import Offload
from glm53.progress import Progress


class Named(Part):
    """A stand-in part: only its name."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


class CpuTier(Named):
    """The CPU tier stand-in: it follows the RAM tier's moves (``FastTier.repoint``)."""

    def repoint(self, row, experts, addresses):
        raise AssertionError("not moved in these tests")


TIER, PREFETCHER = CpuTier("cpu_tier"), Named("prefetch")


class Recorder(Progress):
    def __init__(self, steps):
        super().__init__()
        self.steps_seen = steps

    def phase(self, name, total=None, unit="B"):
        self.steps_seen.append(f"phase {name}")
        super().phase(name, total, unit)


@pytest.fixture
def steps(monkeypatch, tmp_path):
    """Every step of the start replaced by a stand-in that appends its name to the list returned."""
    seen = []

    class Store:
        num_layers, num_experts, arena_bytes, layer_keys = 2, 4, 1 << 20, ["a.mlp", "b.mlp"]
        layout = types.SimpleNamespace(block_bytes=1000)

        @classmethod
        def scan(cls, model_dir):
            seen.append(("scan", model_dir))
            return cls()

        def load(self, progress):
            seen.append("read")
            return 1.5

        def pin_and_map(self, device, register, view, progress):
            seen.append(("pin", register is start.cuda_register, view is start.patches.pinned_cuda_view))

    layers = MoeLayers(mlps=["mlp a", "mlp b"], tables=["tables a", "tables b"], top_k=2, act_limit=7.0)

    def load_offloaded(model, store, load):
        seen.append(("attach", model))
        load()
        return layers

    def cache_slots(settings, block_bytes, total, device):
        seen.append(("size", block_bytes, total))
        return 3, {"limit_bytes": 0, "reserve_bytes": 0}

    class Cache(Part):
        num_slots, name = 3, "cache"

        def __init__(self, kernels, store, tables, slots, device, top_k, policy, profile, link, ram_tier=None):
            seen.append(("fill", tables, slots, top_k, profile, link) + ((("from", ram_tier),) if ram_tier else ()))

    class Stager:
        def __init__(self, store, cache, tables, device, buffer_bytes, min_rows, tiered=None):
            seen.append(("staging", buffer_bytes, min_rows) + ((("beside", tiered.name),) if tiered else ()))

    def tier_start(settings, store, cache, device, kernels, fallbacks, top_k, act_limit, ram_tier=None):
        seen.append(("cpu tier", fallbacks, top_k, act_limit) + (() if ram_tier is None else (("beside", ram_tier),)))
        return TIER, None

    def hook_offload(model, layers_, offload):
        seen.append(("hooks", layers_ is layers, offload.tier))
        return ["remover"]

    for obj, name, value in [
        (start.torch.cuda, "current_device", lambda: 0),
        (start, "HostStore", Store),
        (start.patches, "check_version", lambda: seen.append("version")),
        (start.patches, "load_offloaded", load_offloaded),
        (start.patches, "check_cpu_tier_fits", lambda layers_: seen.append("fits")),
        (start.patches, "fused_experts", lambda mlp: f"fused {mlp}"),
        (start.patches, "hook_offload", hook_offload),
        (start, "Kernels", lambda: "kernels"),
        (start.link, "start", lambda settings, kernels, store, device: (seen.append(("link", settings.link_emulate_gbs)), "the link")[1]),
        (start.budget, "cache_slots", cache_slots),
        (start.profile, "warm_start", lambda model_dir, root, keys: (seen.append(("profile", keys)), (None, "none (cold start)"))[1]),
        (start, "ExpertCache", Cache),
        (start, "PrefillStager", Stager),
        (start.cpu_tier, "start", tier_start),
        (start, "_ram_tier", lambda settings, store: None),  # the host's RAM holds the experts (the tier's test overrides)
    ]:
        monkeypatch.setattr(obj, name, value)
    return seen, tmp_path


def settings_for(tmp_path, mode, *extra):
    return config.load(["--engine", "exl3", "--mode", mode, "-m", str(tmp_path), "--ec-stage-gb", "2", *extra], {})


def test_the_start_runs_its_steps_in_order(steps):
    seen, tmp_path = steps
    progress = Recorder(seen)
    offload = start.start_offload(settings_for(tmp_path, "fast", "--ct-enable", "1"), "the model", lambda: seen.append("load"),
                                  lambda: seen.append("warmup"), progress)
    assert seen == [
        "version", ("scan", tmp_path), "read", ("pin", True, True),
        ("attach", "the model"), "load", "warmup", "phase building the cache", ("link", None),
        ("size", 1000, 8), ("profile", ["a.mlp", "b.mlp"]), ("fill", ["tables a", "tables b"], 3, 2, None, "the link"),
        ("staging", 2 * 1000**3, start.STAGE_MIN_ROWS),
        "fits", ("cpu tier", ["fused mlp a", "fused mlp b"], 2, 7.0),
        ("hooks", True, TIER),
    ]
    assert isinstance(offload, Offload) and offload.tier is TIER and offload.removers == ["remover"]
    assert [p.name for p in offload.parts] == ["cache", "cpu_tier"]  # routed's order
    assert offload.timings["store_read_s"] == 1.5 and offload.profile_source == "none (cold start)"
    assert offload.device == torch.device("cuda", 0)


@pytest.mark.parametrize("mode, extra", [("exact", ()), ("fast", ("--ct-enable", "0"))])
def test_no_cpu_tier_outside_fast_mode_or_when_it_is_off(steps, mode, extra):
    seen, tmp_path = steps
    offload = start.start_offload(settings_for(tmp_path, mode, *extra), "the model", lambda: None, lambda: None)
    assert not [s for s in seen if s == "fits" or s[0] == "cpu tier"]
    assert offload.tier is None and offload.cpu_tier_off_reason is None and seen[-1] == ("hooks", True, None)


@pytest.mark.parametrize("mode, extra", [("exact", ()), ("fast", ("--ct-enable", "0"))])
def test_prefetch_takes_its_slots_from_the_cache_and_comes_first_in_the_parts(steps, monkeypatch, mode, extra):
    """Prefetch never runs beside the CPU tier (the settings refuse it: tests/test_config.py), so the cache is sized
    knowing the pool's slots are used."""
    seen, tmp_path = steps
    monkeypatch.setattr(start.patches, "routers", lambda layers_: [("gate a", None), ("gate b", None)])

    def prefetcher(settings, kernels, cache, routers, top_k, device, policy):
        seen.append(("prefetch", routers, settings.prefetch_slots, settings.prefetch_extra, top_k, settings.prefetch_lead))
        return PREFETCHER

    monkeypatch.setattr(start.prefetch, "from_settings", prefetcher)
    settings = settings_for(tmp_path, mode, "--prefetch", "1", "--prefetch-slots", "2", "--prefetch-extra", "1",
                            "--prefetch-lead", "1", *extra)
    offload = start.start_offload(settings, "the model", lambda: None, lambda: None)
    assert [s for s in seen if s[0] == "fill"][0][2] == 3 - 2  # the budget's 3 slots less the pool's 2
    assert [s for s in seen if s[0] == "prefetch"] == [("prefetch", [("gate a", None), ("gate b", None)], 2, 1, 2, True)]
    assert offload.prefetch is PREFETCHER and [p.name for p in offload.parts] == ["prefetch", "cache"]


class FakeTier:
    """A RAM tier stand-in: its plan, pinning and start recorded."""

    plan = types.SimpleNamespace(policy_slots=2, window_slots=4, ahead_slots=0, bytes=6000)
    arena = np.zeros(6000, dtype=np.uint8)

    def __init__(self, seen):
        self.seen = seen

    def pin(self, register, unregister, view):
        self.seen.append(("pin tier", register is start.cuda_register, unregister is start.cuda_unregister))
        return torch.zeros(6 * 1000, dtype=torch.uint8)

    def start(self, profile, top_k, vram_slots, policy):
        self.seen.append(("tier start", profile.shape, top_k, vram_slots))
        self.policy = policy


class FakeHome(Named):
    """The RAM tier's part: what its ``on_rehome`` tells."""

    def __init__(self):
        super().__init__("ram_tier")
        self.on_rehome = []


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_with_a_ram_tier_the_store_is_not_read_staging_reads_through_it_its_part_acts_first_and_tells_the_cpu_tier(steps, monkeypatch, mode):
    seen, tmp_path = steps
    tier, home = FakeTier(seen), FakeHome()
    monkeypatch.setattr(start, "_ram_tier", lambda settings, store: tier)
    aliased = []
    store_cls = start.HostStore
    monkeypatch.setattr(store_cls, "alias_window", lambda self, window, host: aliased.append((window.numel(), host.numel())), raising=False)
    monkeypatch.setattr(start, "TieredHome", lambda tier_, cache, device, max_picks, routers, write_back: (
        seen.append(("home", tier_ is tier, routers, write_back)), home)[1])
    settings = settings_for(tmp_path, mode, *(("--ct-enable", "1") if mode == "fast" else ()))
    offload = start.start_offload(settings, "the model", lambda: None, lambda: None)
    assert "read" not in seen and not [s for s in seen if s[0] == "pin"]
    assert ("pin tier", True, True) in seen and aliased == [(4 * 1000, 4 * 1000)]  # the window: the arena after the 2 policy slots
    assert seen.index(("size", 1000, 8)) < seen.index(("tier start", (2, 4), 2, 3)) < [s[0] for s in seen].index("fill")
    assert [s for s in seen if s[0] == "fill"][0][-1] == ("from", tier)
    assert ("staging", 2 * 1000**3, start.STAGE_MIN_ROWS, ("beside", "ram_tier")) in seen
    assert offload.cpu_tier_off_reason is None
    if mode == "fast":  # the CPU tier reads the experts in the RAM tier's arena and follows each move of the part's
        assert ("cpu tier", ["fused mlp a", "fused mlp b"], 2, 7.0, ("beside", tier)) in seen
        assert [p.name for p in offload.parts] == ["ram_tier", "cache", "cpu_tier"] and offload.tier is TIER
        assert home.on_rehome == [TIER.repoint]
    else:
        assert not [s for s in seen if s == "fits" or s[0] == "cpu tier"] and home.on_rehome == []
        assert [p.name for p in offload.parts] == ["ram_tier", "cache"] and offload.tier is None
    assert tier.policy == TierPolicy()  # nothing set: the policy's defaults
    assert ("home", True, None, None) in seen  # no reads ahead: no routers; no write-back


def test_a_tier_with_ahead_entries_gets_the_routers_to_guess_with(steps, monkeypatch):
    seen, tmp_path = steps
    tier = FakeTier(seen)
    tier.plan = types.SimpleNamespace(policy_slots=2, window_slots=4, ahead_slots=2, bytes=8000)
    monkeypatch.setattr(start, "_ram_tier", lambda settings, store: tier)
    monkeypatch.setattr(start.HostStore, "alias_window", lambda self, window, host: seen.append(("window", window.numel())), raising=False)
    monkeypatch.setattr(start.patches, "routers", lambda layers: "the routers")
    monkeypatch.setattr(start, "TieredHome", lambda tier_, cache, device, max_picks, routers, write_back: (
        seen.append(("home", routers)), Named("ram_tier"))[1])
    start.start_offload(settings_for(tmp_path, "exact"), "the model", lambda: None, lambda: None)
    assert ("home", "the routers") in seen and ("window", 4 * 1000) in seen  # the window is not the ahead entries


def test_the_ram_tier_settings_reach_the_policy_it_starts_with(steps, monkeypatch):
    seen, tmp_path = steps
    tier = FakeTier(seen)
    monkeypatch.setattr(start, "_ram_tier", lambda settings, store: tier)
    monkeypatch.setattr(start.HostStore, "alias_window", lambda self, window, host: None, raising=False)
    homes = []
    monkeypatch.setattr(start, "TieredHome", lambda tier_, cache, device, max_picks, routers, write_back: (
        homes.append(write_back), Named("ram_tier"))[1])
    settings = settings_for(tmp_path, "exact", "--ram-tier-decay", "0.99", "--ram-tier-hysteresis", "1.5",
                            "--ram-tier-recency-weight", "0", "--ram-tier-vram-score", "0.5", "--ram-tier-exclusive", "0",
                            "--ram-tier-write-back", "1", "--ec-decay", "0.999")
    start.start_offload(settings, "the model", lambda: None, lambda: None)
    assert tier.policy == TierPolicy(decay=0.99, hysteresis=1.5, recency_weight=0.0, vram_score=0.5, exclusive=False,
                                     exclusive_after=1)  # with the write-back
    assert homes == [Policy(decay=0.999)]  # the write-back predicts the VRAM cache's steps by the cache's own policy
