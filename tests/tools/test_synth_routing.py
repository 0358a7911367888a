"""glm53 synth's routing dynamics (glm53.tools.synth.routing): the gates' structure, determinism from the seed, the
twin's correlations, and a trained checkpoint whose twin read from its files is the one built from its settings."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from bench import routing_stats
from glm53 import cli
from glm53.models.safetensors_header import read_header
from glm53.tools.synth import presets, routing, writer

PROFILE = Path(__file__).resolve().parents[2] / "glm53" / "models" / "glm53-flash-routing-profile.json"
TRAINED = presets.ROUTING_PRESETS["trained"].dynamics


@pytest.fixture(scope="module")
def tiny_trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("routing") / "tiny-trained"
    assert cli.main(["synth", "--preset", "tiny", "--routing", "trained", "--seed", "5", "--out", str(out),
                     "--profile", str(PROFILE)]) == 0
    yield out
    shutil.rmtree(out.parent)  # 0.6 GB


def _gate(ckpt: Path, layer: int) -> np.ndarray:
    name = f"model.language_model.layers.{layer}.mlp.gate.weight"
    for shard in sorted(ckpt.glob("*.safetensors")):
        header, start = read_header(shard)
        if name in header:
            begin, end = header[name]["data_offsets"]
            with open(shard, "rb") as f:
                f.seek(start + begin)
                return np.frombuffer(f.read(end - begin), dtype="<f2").reshape(header[name]["shape"])
    raise KeyError(name)


def test_gates_read_one_shared_subspace_with_unit_logit_rows():
    a = routing.gate_weight(7, 3, 288, 256, TRAINED, sigma=1.0)
    b = routing.gate_weight(7, 4, 288, 256, TRAINED, sigma=1.0)
    assert a.shape == (288, 256) and a.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-5)  # logits N(0, 1) on a unit-RMS input
    assert np.linalg.matrix_rank(np.vstack([a, b]).astype(np.float64), tol=1e-4) == TRAINED.rank  # one subspace
    assert not np.allclose(a, b)  # each layer its own directions in it
    np.testing.assert_array_equal(a, routing.gate_weight(7, 3, 288, 256, TRAINED, sigma=1.0))
    assert not np.allclose(a, routing.gate_weight(8, 3, 288, 256, TRAINED, sigma=1.0))


def test_the_twins_states_have_the_set_correlations_over_tokens_and_layers():
    dyn = presets.Dynamics(temporal=0.6, layer_carry=0.9, rank=32)
    twin = routing.Twin(1, [3, 4, 5], [np.zeros(64, np.float32)] * 3, 4, dyn)
    states = twin._states(np.random.default_rng(0), 20000)  # [steps, layers, rank]
    lag1 = np.mean(states[1:] * states[:-1])
    lag3 = np.mean(states[3:] * states[:-3])
    across = np.mean(states[:, 1:] * states[:, :-1])
    assert abs(np.mean(states**2) - 1.0) < 0.02  # stationary from the first step
    assert abs(lag1 - 0.6) < 0.02 and abs(lag3 - 0.6**3) < 0.02 and abs(across - 0.9) < 0.02


def test_the_twin_is_a_function_of_its_seeds():
    twin, _ = routing_stats.twin_from_settings("tiny", "trained", 2, None)
    one, again = twin.run(50, 0), twin.run(50, 0)
    np.testing.assert_array_equal(one.picks, again.picks)
    np.testing.assert_array_equal(one.next_logits, again.next_logits)
    assert not np.array_equal(one.picks, twin.run(50, 1).picks)
    assert one.picks.shape == (50, 5, 4) and one.next_logits.shape == (50, 4, 16)
    assert all(len(set(row)) == 4 for row in one.picks.reshape(-1, 4))  # top-k picks distinct experts


@pytest.mark.parametrize("name", ["random", "trained"])
def test_the_twins_picks_are_the_top_k_of_the_logits_it_carries(name):
    twin, _ = routing_stats.twin_from_settings("tiny", name, 2, None)
    run = twin.run(40, 3)
    assert run.logits.shape == (40, 5, 16) and run.logits.dtype == np.float32
    for i in range(5):
        np.testing.assert_array_equal(run.picks[:, i], routing.top_picks(run.logits[:, i], twin.biases[i], 4))


def test_unknown_routing_presets_and_bad_dynamics_are_refused():
    with pytest.raises(ValueError, match="unknown routing 'smooth'"):
        routing.resolve("smooth")
    with pytest.raises(ValueError, match="bad routing dynamics"):
        presets.Dynamics(temporal=1.0, layer_carry=0.5, rank=8)


def test_a_trained_checkpoint_records_its_routing_and_its_twin_is_the_one_its_settings_give(tiny_trained):
    synth = json.loads((tiny_trained / "config.json").read_text())["glm53_synth"]
    assert synth["routing"] == {"preset": "trained", "temporal": TRAINED.temporal,
                                "layer_carry": TRAINED.layer_carry, "rank": TRAINED.rank}
    shape = presets.resolve("tiny")
    for layer in shape.moe_layer_indices[::2]:
        want = routing.gate_weight(5, layer, shape.experts, shape.hidden, TRAINED, presets.SCALES.router_sigma)
        np.testing.assert_array_equal(_gate(tiny_trained, layer), want.astype(np.float16))
    from_files, shares, name = routing_stats.twin_from_checkpoint(tiny_trained)
    from_settings, targets = routing_stats.twin_from_settings("tiny", "trained", 5, None)
    assert name == "trained" and from_files.layers == shape.moe_layer_indices
    for a, b in zip(from_files.biases, from_settings.biases):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(shares, targets, atol=1e-6)  # the shipped profile is the fitted targets (rounded)
    np.testing.assert_array_equal(from_files.run(40).picks, from_settings.run(40).picks)


def test_the_trained_bias_fit_reproduces_the_profiles_popularity():
    shape = presets.resolve("scaled", 2)
    targets = writer.router_targets(shape, json.loads(PROFILE.read_text()))
    biases = writer.fit_biases(shape, targets, presets.SCALES, 0, TRAINED)
    states = routing.fit_states(1, 20000, TRAINED.rank)  # a fresh sample, not the one fitted on
    for layer, target in targets.items():
        logits = states @ routing.expert_directions(0, layer, 288, TRAINED.rank).T.astype(np.float32)
        counts = np.bincount(routing.top_picks(logits, biases[layer], 8).reshape(-1), minlength=288)
        assert 0.5 * np.abs(counts / counts.sum() - target).sum() < 0.06
        assert math.isclose(np.sort(counts)[::-1][:32].sum() / counts.sum(), np.sort(target)[::-1][:32].sum(), abs_tol=0.02)
