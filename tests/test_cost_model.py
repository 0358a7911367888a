"""The one cost model (glm53.cost_model): routing's misses at a VRAM share, a decode step in exact and fast mode, a
prefill, host RAM, and the rigs' projections, against values worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from glm53 import cost_model as cm

US = 1e-6
PROFILE = cm.load_profile(cm.PROFILE)


def test_the_profile_is_the_real_models_and_its_hit_rate_grows_with_the_slots():
    assert PROFILE.shape == (42, 288) and np.allclose(PROFILE.sum(axis=1), PROFILE.sum(axis=1)[0])
    rates = [cm.hit_rate(PROFILE, s) for s in (0, 16, 32, 64, 288)]
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(1.0) and rates == sorted(rates)
    assert 0.3 < rates[2] < 0.45  # a 24 GB card's 32 a layer (the original project's cache: 37 % of picks in VRAM)


def test_distinct_misses_at_one_token_are_top_k_times_the_miss_rate_and_overlap_beyond():
    missed, resident = cm.distinct_misses(PROFILE, 32, 8, 1)
    assert missed == pytest.approx(8 * (1 - cm.hit_rate(PROFILE, 32)), rel=1e-6) and missed + resident == pytest.approx(8)
    four, _ = cm.distinct_misses(PROFILE, 32, 8, 4)
    assert 3 * missed < four < 4 * missed  # four tokens share some of their missed experts


COSTS = cm.Costs({1: 200 * US, 4: 300 * US}, handoff_s=20 * US, link_expert_s=380 * US, vram_expert_s=2 * US, gpu_fixed_s=80 * US,
                 cpu_job_s={1: 200 * US, 4: 200 * US})


def test_a_step_in_exact_mode_adds_each_layers_misses_read_over_the_link():
    step = cm.Step(fixed_s=5e-3, moe_layers=12, misses=5.0, hits=3.0)
    assert cm.exact_step_s(step, COSTS) == pytest.approx(5e-3 + 12 * 5 * 380 * US)


def test_a_step_in_fast_mode_takes_the_slower_of_the_two_sides_at_the_splits_k():
    step = cm.Step(fixed_s=5e-3, moe_layers=12, misses=5.0, hits=3.0)
    seconds, k = cm.fast_step_s(step, COSTS, hook_s=60 * US)
    # by hand: k = 2 gives max(80 + 6 + 3 x 380, 20 + 200 + 2 x 200) = 1226 us; k = 3: max(846, 820) = 846 us
    assert k == 3
    assert seconds == pytest.approx(5e-3 + 12 * (846 * US - 86 * US + 60 * US))
    between, k = cm.fast_step_s(cm.Step(5e-3, 12, 5.5, 3.0), COSTS)  # half-way misses: half-way times
    lo, hi = (cm.fast_step_s(cm.Step(5e-3, 12, m, 3.0), COSTS)[0] for m in (5.0, 6.0))
    assert between == pytest.approx((lo + hi) / 2)
    slow = cm.Costs({1: 5e-3}, 0.0, 380 * US, 2 * US, gpu_fixed_s=80 * US)
    seconds, k = cm.fast_step_s(step, slow)
    assert k == 0 and seconds == pytest.approx(cm.exact_step_s(step, slow))  # a CPU slower than the link gets nothing


def test_a_prefill_takes_the_longer_of_its_compute_and_its_copies_and_exact_mode_streams_once_more():
    copy = 42 * 256 * 9.44e6 / 25e9  # a chunk's expert stream at 25 GB/s: 4.06 s
    assert cm.prefill_s(8192, 42, 1 / 700, 256 * 9.44e6, 25.0) == pytest.approx(8192 / 700)  # compute-bound
    assert cm.prefill_s(8192, 42, 1 / 7000, 256 * 9.44e6, 25.0) == pytest.approx(copy)  # link-bound
    split = cm.prefill_s(8192, 42, 1 / 7000, 256 * 9.44e6, 25.0, last_page_split=True, zero_copy_gbs=50.0)
    assert split == pytest.approx(copy + copy / 2)


def test_host_ram_per_mode():
    assert cm.host_ram_needed(100, 16, "exact", 8) == 102 + 6 * 2**30
    assert cm.host_ram_needed(100, 16, "fast", 8) == 102 + 6 * 2**30 + 16 + 8 * 64 * 2**20


def test_the_original_projects_rig_is_projected_beside_its_published_figures():
    rig = cm.PRESETS["anchor-3090-epyc7443p"]
    p = cm.project(rig, PROFILE)
    assert p.slots_per_layer == 32  # its cache held 1,376 slots (32.8 a layer) on the same card
    assert 0.75 * rig.published["exact_tok_s"] < p.decode_tok_s["exact"][1] < 1.1 * rig.published["exact_tok_s"]
    assert p.decode_tok_s["fast"][1] > 1.5 * p.decode_tok_s["exact"][1] and p.cpu_experts_per_layer[1] > 1
    assert p.decode_tok_s["fast"][4] > p.decode_tok_s["fast"][1] and p.host_ram_gib["fast"] > p.host_ram_gib["exact"] > 114
    assert "25 GB/s" in p.bound["exact"]


def test_a_described_rig_rederives_the_cpu_tiers_figures_and_refuses_an_unknown_isa():
    base = cm.PRESETS["pcie4-4090-7950x"]
    more = cm.described(base, cores=32, dram_gbs=200)
    assert more.cpu_expert_s[1] == pytest.approx(9.44e6 / (31 * 5.1e9 * 0.8))
    assert "not measured" in more.sources["cpu_expert_s"]
    capped = cm.described(base, cores=64, dram_gbs=60)
    assert capped.cpu_expert_s[1] == pytest.approx(9.44e6 / (0.8 * 60e9))  # the DRAM read rate bounds the tier
    assert cm.described(base, gpu="NVIDIA GeForce RTX 3090").hbm_gbs == 936
    with pytest.raises(ValueError, match="--isa 'neon' is not accepted"):
        cm.described(base, isa="neon")


def test_the_ram_tiers_misses_add_their_disk_read_to_the_link_read_in_both_modes():
    costs = cm.Costs(cpu_expert_s={1: 300e-6}, handoff_s=20e-6, link_expert_s=400e-6, vram_expert_s=2e-6, gpu_fixed_s=80e-6,
                     disk_expert_s=1.35e-3)
    step = cm.Step(fixed_s=0.02, moe_layers=42, misses=6.0, hits=2.0, tokens=1)
    tiered = cm.Step(fixed_s=0.02, moe_layers=42, misses=6.0, hits=2.0, tokens=1, disk_misses=1.5)
    assert cm.exact_step_s(step, costs) == pytest.approx(0.02 + 42 * 6 * 400e-6)
    assert cm.exact_step_s(tiered, costs) - cm.exact_step_s(step, costs) == pytest.approx(42 * 1.5 * 1.35e-3)
    assert cm.fast_step_s(tiered, costs)[0] - cm.fast_step_s(step, costs)[0] == pytest.approx(42 * 1.5 * 1.35e-3)
    with pytest.raises(ValueError, match="disk_expert_s must be a finite number >= 0"):
        cm.Costs(cpu_expert_s={1: 1e-4}, handoff_s=0, link_expert_s=0, vram_expert_s=0, disk_expert_s=-1.0)


def test_a_rig_whose_ram_holds_every_expert_has_no_ram_tier():
    rig = cm.PRESETS["pcie4-4090-7950x"]
    assert rig.ram_tier_slots_per_layer() is None
    short = cm.described(rig, ram_gib=40)
    budget = cm.expert_ram_budget(40 * 2**30, cm.GLM53_FLASH.sign_scale_bytes, "exact", 1)
    assert short.ram_tier_slots_per_layer() == pytest.approx((budget / (1.02 * 9.44e6) - 288) / 42)  # less the window
