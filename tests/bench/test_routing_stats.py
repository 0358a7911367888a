"""bench.routing_stats: its figures on traces worked out by hand, and each routing preset's twin landing in the
preset's bands."""

from __future__ import annotations

import numpy as np
import pytest

from bench import routing_stats as rs
from glm53.tools.synth import presets


def test_reuse_distances_count_steps_since_the_layers_last_pick_of_the_expert():
    picks = np.array([[0, 1], [2, 0], [0, 3], [1, 2]])  # [steps, top_k]
    assert rs.reuse_distances(picks).tolist() == [0, 0, 0, 1, 1, 0, 3, 2]
    hist = rs.reuse_histogram(rs.reuse_distances(picks))
    assert (hist["first"], hist["<=1"], hist["<=2"], hist["<=4"], hist["longer"]) == (0.5, 0.25, 0.125, 0.125, 0.0)


def test_guess_scores_count_true_picks_among_the_first_n_guesses():
    truth = np.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    guesses = np.array([[1, 2, 3, 4, 90, 91, 92, 93, 5, 6, 94, 95, 96, 97, 98, 99]])
    assert rs.guess_scores(truth, guesses) == {"recall_8": 0.5, "precision_8": 0.5, "recall_16": 0.75, "precision_16": 0.375}


def test_hit_rates_start_from_the_hottest_experts():
    picks = np.array([[2, 3], [0, 1], [2, 3]])
    shares = np.array([0.4, 0.3, 0.2, 0.1])
    # 2 slots start with experts 0 and 1; admitting every miss, each step evicts what the next step picks
    assert rs.hit_rate("lru", picks, shares, 2) == 0.0
    assert rs.hit_rate("lfu", picks, shares, 2) == 0.0
    assert rs.hit_rate("belady", picks, shares, 2) == pytest.approx(2 / 6)  # one of the two pairs is kept and hit


def test_popularity_compares_pick_shares_with_the_target():
    picks = np.array([[0, 1], [0, 2]])
    got = rs.popularity(picks, np.array([0.5, 0.25, 0.25, 0.0]))
    assert got["tv"] == 0.0 and got["top32"] == got["top32_target"] == 1.0


@pytest.mark.parametrize("routing", ["random", "trained"])
def test_each_routing_presets_twin_lands_in_its_bands(routing):
    twin, shares = rs.twin_from_settings("scaled", routing, 0, 3)  # 288 experts top-8, the bands' shape
    picks, guesses = rs.twin_trace(twin, 1500)
    result = rs.measure(picks, guesses, shares, slots=(64,), policies=("lru",))
    bands = rs.check_bands(routing, result["overall"], twin.experts, twin.top_k)
    assert bands["applies"] and set(bands["checks"]) == set(presets.ROUTING_PRESETS[routing].bands)
    assert bands["accepted"], bands["checks"]
    # the presets are told apart by what they set, not by popularity
    recall = result["overall"]["next_gate"]["recall_8"]
    assert (recall > 0.7) == (routing == "trained")
    assert result["overall"]["next_gate"]["recall_16"] > (0.9 if routing == "trained" else 0.0)


def test_bands_are_not_checked_on_another_routing_shape():
    twin, shares = rs.twin_from_settings("tiny", "trained", 0, None)  # 16 experts top-4
    picks, guesses = rs.twin_trace(twin, 100)
    overall = rs.measure(picks, guesses, shares, slots=(8,), policies=("lru",))["overall"]
    assert rs.check_bands("trained", overall, twin.experts, twin.top_k) == {"applies": False, "checks": {}}
