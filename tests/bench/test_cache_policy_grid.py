"""The grid's replay of every layer at once is the reference's replay, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from bench import cache_policy_grid as grid
from bench import cache_policy_sim as sim
from glm53.offload.cache import Policy


@pytest.mark.parametrize("policy", [Policy(), Policy(decay=0.999, recency_weight=800.0, hysteresis=1.1, warm_horizon=100.0),
                                    Policy(recency_weight=0.0, max_admit=1)])
def test_the_replay_of_all_layers_at_once_is_the_references(policy):
    profile = sim.load_profile(sim.PROFILE)[:4]
    trace = sim.make_trace(profile, steps=150, top_k=8, mode="drift", seed=1)
    recurring = trace.copy()
    recurring[1::2, :, :4] = trace[:-1:2, :, :4]  # half of every other step's picks repeat: a measured reuse lift
    for t in (trace, recurring):
        grid.check(t, sim.starting_residents(profile, round(0.11 * profile.size)), profile, policy)


def test_the_grid_leaves_out_horizons_that_change_nothing():
    rows = grid.settings({"decay": (0.995, 0.999), "warm_horizon": (None, 100.0, 200.0, 400.0)})
    assert rows == [{"decay": 0.995, "warm_horizon": None}, {"decay": 0.995, "warm_horizon": 100.0},
                    {"decay": 0.999, "warm_horizon": None}, {"decay": 0.999, "warm_horizon": 100.0},
                    {"decay": 0.999, "warm_horizon": 200.0}, {"decay": 0.999, "warm_horizon": 400.0}]
