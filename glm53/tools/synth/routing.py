"""Routing dynamics of a synthetic checkpoint: how a layer's picks recur over tokens and how well the next layer's
gate, applied to this layer's router input, predicts the next layer's picks. Popularity is the profile's either way
(``router``: the selection bias is fitted to it under the dynamics chosen here).

Two presets. ``random`` is the router the bias fit has always assumed: logits i.i.d. ``N(0, sigma^2)`` per expert,
token and layer, so picks recur only by popularity and the next layer's gate on this layer's input is a guess.
``trained`` sets the two figures that trained MoE models are published with (the next layer's gate on the current
hidden state finds 66-88 % of the next layer's top-8; a per-layer LRU of 64 of 256 experts hits 67 %, of 128 81 %).

The mechanism: an explicit low-rank routing signal shared across layers, the component of the residual stream in a
``rank``-dimensional subspace ``P`` (orthonormal, [hidden, rank]) that every MoE layer's gate reads,
``gate_l = sigma * M_l P^T`` (``M_l`` [experts, rank], unit rows: each logit is ``N(0, sigma^2)`` on a unit-RMS
input, as before). The routing state ``x[t, l] = P^T h`` (unit variance per component) moves as a residual stream
with attention over neighbouring positions would move it:

- across layers, ``x[t, l] = c x[t, l - 1] + sqrt(1 - c^2) y[t, l]``: each layer's update ``y`` has scale
  ``sqrt(1 - c^2)`` against the stream (``layer_carry = c``, the correlation of consecutive layers' routing states,
  and so of the next layer's logits on this layer's state with its true ones);
- across tokens, every update and the stream entering the first MoE layer are AR(1) in the position,
  ``y[t] = r y[t - 1] + sqrt(1 - r^2) e[t]`` (``temporal = r``: the lag-n correlation of every routing state is
  ``r ** n``), which is what attention's mixing of the previous positions into the current one does.

Why this and not the real network's update scales and attention weights: with random weights the hidden state's
evolution through KDA, MLA, mHC and the experts has no closed form, so figures set through those scales could only be
found by running the full model; the low-rank signal has one knob per figure, independent of each other (recall
follows ``layer_carry`` alone, LRU hits ``temporal`` alone, measured in ``bench.routing_stats``), and its twin (the
routing state alone, ``rank`` wide, with the checkpoint's gates' ``M_l`` and biases) runs on a CPU in seconds. What
the real network's hidden states do in ``P`` is not set by this: the engine's routing hook measures it on the GPU
(``bench.routing_stats --engine``).

Everything is a function of the seed: ``P`` and each ``M_l`` come from Philox streams keyed by name (``name_key``),
the twin's noise from one keyed by the trace seed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .presets import ROUTING_PRESETS, Dynamics, RoutingPreset
from .random_pool import name_key
from .tensors import PREFIX


def resolve(name: str) -> RoutingPreset:
    """:raise ValueError: an unknown routing preset."""
    if name not in ROUTING_PRESETS:
        raise ValueError(f"unknown routing {name!r}; choose one of {', '.join(ROUTING_PRESETS)}")
    return ROUTING_PRESETS[name]


def record(name: str) -> dict | None:
    """The ``routing`` entry of the checkpoint's ``glm53_synth`` block; None for ``random``, whose checkpoints are
    byte for byte what they were before routing had settings."""
    dynamics = resolve(name).dynamics
    return None if dynamics is None else {"preset": name, **asdict(dynamics)}


def from_record(synth: Mapping) -> tuple[str, Dynamics | None]:
    """(preset name, dynamics) of a checkpoint from its ``glm53_synth`` block (no entry: ``random``)."""
    entry = synth.get("routing")
    if entry is None:
        return "random", None
    return entry["preset"], Dynamics(entry["temporal"], entry["layer_carry"], entry["rank"])


def _generator(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=name_key(seed, name)))


def routing_basis(seed: int, hidden: int, rank: int) -> np.ndarray:
    """float64 [hidden, rank] orthonormal columns: the subspace every gate reads."""
    q, r = np.linalg.qr(_generator(seed, "routing-basis").standard_normal((hidden, rank)))
    return q * np.sign(np.diag(r))  # the sign convention makes the basis a function of the draw alone


def expert_directions(seed: int, layer: int, experts: int, rank: int) -> np.ndarray:
    """float64 [experts, rank], unit rows: MoE layer ``layer``'s (decoder index) gate within the routing subspace."""
    m = _generator(seed, f"{PREFIX}.layers.{layer}.mlp.gate.directions").standard_normal((experts, rank))
    return m / np.linalg.norm(m, axis=1, keepdims=True)


def gate_weight(seed: int, layer: int, experts: int, hidden: int, dynamics: Dynamics, sigma: float) -> np.ndarray:
    """float32 [experts, hidden] (HF orientation) ``sigma * M_l P^T``: each row has norm ``sigma``, as the i.i.d.
    gate of std ``sigma/sqrt(hidden)`` has on average."""
    basis = routing_basis(seed, hidden, dynamics.rank)
    return (sigma * expert_directions(seed, layer, experts, dynamics.rank) @ basis.T).astype(np.float32)


def fit_states(seed: int, tokens: int, rank: int) -> np.ndarray:
    """float32 [tokens, rank]: routing states drawn from their stationary law ``N(0, I)``, for the bias fit (one
    sample shared by the layers, as the i.i.d. fit shares its scores)."""
    return _generator(seed, "router-fit-states").standard_normal((tokens, rank), dtype=np.float32)


def fit_scores(states: np.ndarray, directions: np.ndarray, sigma: float) -> np.ndarray:
    """float32 [tokens, experts] router scores ``sigmoid(sigma * M x)`` of the states."""
    z = states @ (np.float32(sigma) * directions.astype(np.float32)).T
    return 1.0 / (1.0 + np.exp(-z))


def top_picks(logits: np.ndarray, bias: np.ndarray, n: int) -> np.ndarray:
    """int64 [..., n]: exllamav3's ``dots`` selection, the top ``n`` of ``sigmoid(logits) + bias``, best first,
    ties to the lower expert id."""
    score = 1.0 / (1.0 + np.exp(-logits.astype(np.float32))) + bias.astype(np.float32)
    return np.argsort(-score, axis=-1, kind="stable")[..., :n].astype(np.int64)


@dataclass(frozen=True)
class TwinTrace:
    picks: np.ndarray  # int64 [steps, layers, top_k]: each layer's routing, one token per step
    next_logits: np.ndarray  # float32 [steps, layers - 1, experts]: layer l + 1's gate on layer l's routing state
    logits: np.ndarray  # float32 [steps, layers, experts]: each layer's gate on its own routing state, what it picked by


class Twin:
    """The routing of a checkpoint without the rest of it: the routing state of each MoE layer over a sequence of
    tokens, the gates' logits on it and the checkpoint's selection biases (see the module docstring).

    :param layers: decoder indices of the MoE layers (they key each gate's directions).
    :param biases: per MoE layer, float32 [experts] ``e_score_correction_bias``.
    :param dynamics: None for i.i.d. logits (``random``).
    """

    def __init__(self, seed: int, layers: Sequence[int], biases: Sequence[np.ndarray], top_k: int,
                 dynamics: Dynamics | None, sigma: float = 1.0):
        if len(layers) != len(biases) or not layers:
            raise ValueError(f"{len(biases)} biases for {len(layers)} MoE layers")
        self.seed, self.layers, self.top_k, self.dynamics, self.sigma = seed, list(layers), top_k, dynamics, sigma
        self.biases = [np.asarray(b, dtype=np.float32) for b in biases]
        self.experts = self.biases[0].shape[0]
        self.directions = None if dynamics is None else np.stack(
            [expert_directions(seed, layer, self.experts, dynamics.rank) for layer in self.layers]).astype(np.float32)

    def run(self, steps: int, trace_seed: int = 0) -> TwinTrace:
        """``steps`` tokens from the stationary state (no warm-up: every state starts at its stationary law)."""
        rng = _generator(self.seed, f"routing-twin.{trace_seed}")
        n = len(self.layers)
        if self.dynamics is None:
            logits = self.sigma * rng.standard_normal((steps, n, self.experts), dtype=np.float32)
            # no carry: this layer's input says nothing of the next layer's logits
            next_logits = self.sigma * rng.standard_normal((steps, n - 1, self.experts), dtype=np.float32)
        else:
            states = self._states(rng, steps)  # [steps, layers, rank]
            m = np.float32(self.sigma) * self.directions  # [layers, experts, rank]
            logits = np.einsum("tlr,ler->tle", states, m)
            next_logits = np.einsum("tlr,ler->tle", states[:, :-1], m[1:])
        picks = np.stack([top_picks(logits[:, i], self.biases[i], self.top_k) for i in range(n)], axis=1)
        return TwinTrace(picks, next_logits.astype(np.float32), logits.astype(np.float32))

    def _states(self, rng: np.random.Generator, steps: int) -> np.ndarray:
        d = self.dynamics
        n = len(self.layers)
        r, keep = np.float32(d.temporal), np.float32(math.sqrt(1.0 - d.temporal**2))
        carry, update = np.float32(d.layer_carry), np.float32(math.sqrt(1.0 - d.layer_carry**2))
        noise = rng.standard_normal((steps, n + 1, d.rank), dtype=np.float32)  # [:, 0]: the stream entering layer 0
        drive = np.empty_like(noise)
        drive[0] = noise[0]
        for t in range(1, steps):
            drive[t] = r * drive[t - 1] + keep * noise[t]
        states = np.empty((steps, n, d.rank), dtype=np.float32)
        prev = drive[:, 0]
        for i in range(n):
            prev = carry * prev + update * drive[:, i + 1]
            states[:, i] = prev
        return states
