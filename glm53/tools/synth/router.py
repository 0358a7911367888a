"""Router realism: per-expert popularity from GLM-5.3-Flash's measured routing profile.

The profile (``glm53/models/glm53-flash-routing-profile.json``) holds, for each real MoE layer 3..44, how often
each of the 288 experts was picked on real decode traffic, keyed ``model.language_model.layers.N.mlp`` (the
``EXL3_MOE_CPU_SPLIT_STATS`` form). A synthetic checkpoint reproduces those shares through the selection-only
``e_score_correction_bias``: exllamav3's ``dots`` router picks the top-k of ``sigmoid(logit) + bias``.

The router model behind the fit: logits i.i.d. N(0, sigma^2) per expert and token (the gate has std
``sigma/sqrt(hidden)`` on a unit-RMS input). Real activations are not i.i.d., and on the GPU the synthetic
model's routing came out less skewed than this model predicts; :func:`calibrate_bias` is the step for
correcting a checkpoint from routing measured on the device (see ``write_router_biases``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist

import numpy as np

FIRST_REAL_MOE = 3
LAST_REAL_MOE = 44
PSEUDO_COUNT = 0.5  # picks added per expert: a share of exactly 0 would need a bias of -inf
MAX_LOG_RATIO = 2.0  # clip on ln(target/measured): an expert seen a few times cannot make a huge step
FIT_TOKENS = 65536  # Monte-Carlo sample of router scores, shared by the layers of one checkpoint
FIT_BLOCK = 2048
FIT_ITERATIONS = 64
FIT_BURN_IN = 16
FIT_DAMPING = 0.5


def profile_key(layer: int) -> str:
    return f"model.language_model.layers.{layer}.mlp"


def load_profile(path: Path) -> dict[str, list[float]]:
    """A routing profile: ``{"model.language_model.layers.N.mlp": [count per expert]}``."""
    return json.loads(Path(path).read_text())


def layer_map(n_moe: int) -> list[int]:
    """The real MoE layer each of ``n_moe`` synthetic MoE layers takes its popularity from.

    Synthetic layer j takes real layer ``3 + round(j * 41 / (n - 1))`` with halves rounded up, spreading the
    synthetic layers evenly from the first real MoE layer (3) to the last (44); one layer takes layer 3.
    """
    if n_moe < 1:
        raise ValueError(f"need at least one MoE layer, got {n_moe}")
    if n_moe == 1:
        return [FIRST_REAL_MOE]
    span = LAST_REAL_MOE - FIRST_REAL_MOE
    # floor(j * span / (n - 1) + 1/2) in integers, so no float rounding decides a tie
    return [FIRST_REAL_MOE + (2 * j * span + n_moe - 1) // (2 * (n_moe - 1)) for j in range(n_moe)]


def target_shares(profile: dict[str, list[float]], real_layer: int, n_experts: int) -> np.ndarray:
    """Per-expert share of picks (sums to 1) for a synthetic layer of ``n_experts`` taking ``real_layer``.

    With fewer experts than the profile's 288, expert i takes real expert ``floor(i * 288 / n_experts)``: an
    evenly spaced subsample in the real index order. It keeps the spread of popularities (a sample of it),
    where summing groups of experts would average the skew away. Every count gets ``PSEUDO_COUNT`` added.

    :raise ValueError: the profile has no such layer, or fewer experts than asked for.
    """
    if profile_key(real_layer) not in profile:
        raise ValueError(f"the routing profile has no entry {profile_key(real_layer)!r}")
    counts = np.asarray(profile[profile_key(real_layer)], dtype=np.float64)
    if n_experts > len(counts):
        raise ValueError(f"the profile has {len(counts)} experts per layer, cannot make {n_experts}")
    picked = counts[(np.arange(n_experts) * len(counts)) // n_experts] + PSEUDO_COUNT
    return picked / picked.sum()


def top_share(counts, k: int = 32) -> float:
    """Share of all picks that go to the ``k`` most-picked experts (uniform routing over E gives k/E)."""
    counts = np.asarray(counts, dtype=np.float64)
    return float(np.sort(counts)[::-1][:k].sum() / counts.sum())


def calibrate_bias(bias: np.ndarray, measured_counts, target_shares: np.ndarray, step) -> np.ndarray:
    """One damped update of the selection bias that moves measured pick shares toward the target shares.

    Rule: ``b += step * clip(ln t - ln m, -2, 2)``, then ``b -= mean(b)``, where ``m`` is the measured share
    with ``PSEUDO_COUNT`` picks added per expert and ``t`` the target share. It is the aux-loss-free balancing
    update (DeepSeek-V3: ``b += gamma * sign(t - m)``) with the sign replaced by the log ratio, so an expert
    moves in proportion to how far off it is and the update settles instead of chattering by +-gamma. Selection
    is shift-invariant, so centring changes no routing; it keeps the values near zero, where the fp16 copy
    exllamav3 routes with is most precise.

    :param step: bias units per unit of log ratio, a scalar or one per expert. A full Newton step is
        ``1 / (d ln share / d bias)``: about 0.05 for top-8 of 288 with sigma 1 and 0.02 with sigma 2 (see
        ``_mean_field``), so for shares measured on a device, whose effective sigma is unknown, 0.01-0.02 is
        safe; a step past the Newton step makes the shares oscillate instead of converging.
    :return: the new bias, float32.
    """
    m = np.asarray(measured_counts, dtype=np.float64) + PSEUDO_COUNT
    m /= m.sum()
    t = np.asarray(target_shares, dtype=np.float64)
    t = np.maximum(t / t.sum(), 1e-12)
    new = np.asarray(bias, dtype=np.float64) + np.asarray(step) * np.clip(np.log(t / m), -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (new - new.mean()).astype(np.float32)


def route_counts(scores: np.ndarray, bias: np.ndarray, top_k: int) -> np.ndarray:
    """Picks per expert when each row of ``scores`` [tokens, E] selects its top-k of ``scores + bias``."""
    n_experts = scores.shape[1]
    biased = scores + bias.astype(scores.dtype)
    kth = np.partition(biased, n_experts - top_k, axis=1)[:, n_experts - top_k]  # [tokens]
    return (biased >= kth[:, None]).sum(axis=0)


def sample_scores(rng: np.random.Generator, tokens: int, n_experts: int, sigma: float) -> np.ndarray:
    """Router scores ``sigmoid(z)``, ``z ~ N(0, sigma^2)`` i.i.d.: [tokens, E] float32."""
    z = rng.standard_normal((tokens, n_experts), dtype=np.float32) * np.float32(sigma)
    return 1.0 / (1.0 + np.exp(-z))


def _mean_field(target: np.ndarray, top_k: int, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """Closed-form start for the fit and its sensitivity ``d ln share / d bias``, per expert.

    With many experts the top-k cut of a token is nearly a constant ``tau``, so expert e is picked with
    probability ``Q(u)``, ``u = logit(tau - b) / sigma`` (Q the normal tail). Setting that to ``k * share``
    gives ``b = tau - sigmoid(sigma * Q^-1(k * share))``, with ``tau`` chosen so the biases average zero.
    """
    normal = NormalDist()
    p = np.clip(top_k * target, 1e-9, 1 - 1e-6)
    u = np.array([normal.inv_cdf(1 - q) for q in p])
    x = 1.0 / (1.0 + np.exp(-sigma * u))  # the score an expert must beat: tau - b
    hazard = np.array([normal.pdf(v) for v in u]) / p
    slope = hazard / (sigma * x * (1 - x))
    return x.mean() - x, slope


def fit_bias(target: np.ndarray, top_k: int, scores: np.ndarray, sigma: float = 1.0) -> np.ndarray:
    """The selection bias under which top-k routing of i.i.d. N(0, sigma^2) logits picks experts with ``target`` shares.

    Starts from the mean-field bias, then runs aux-loss-free style updates (:func:`calibrate_bias`, with a
    per-expert Newton step ``FIT_DAMPING / slope``) on Monte-Carlo counts: iteration i routes block
    ``i mod n`` of ``FIT_BLOCK`` tokens of ``scores`` (from :func:`sample_scores`, shared by all layers), and
    the result is the mean of the iterates after ``FIT_BURN_IN``, which averages the blocks' sampling noise
    down to that of the whole sample. With 65536 tokens, 288 experts and top-8 the fitted shares are within a
    total-variation distance of ~0.01 of the target (0.15-0.3 s per layer on one core).
    """
    target = np.asarray(target, dtype=np.float64)
    target = target / target.sum()
    bias, slope = _mean_field(target, top_k, sigma)
    step = FIT_DAMPING / slope
    blocks = max(1, len(scores) // FIT_BLOCK)
    total = np.zeros_like(bias)
    for i in range(FIT_ITERATIONS):
        block = scores[(i % blocks) * FIT_BLOCK : (i % blocks + 1) * FIT_BLOCK]
        bias = calibrate_bias(bias, route_counts(block, bias, top_k), target, step)
        if i >= FIT_BURN_IN:
            total += bias
    return (total / (FIT_ITERATIONS - FIT_BURN_IN)).astype(np.float32)


def stats_counts(shares: np.ndarray, total: float) -> list[float]:
    """Shares as pick counts totalling ``total``, as the ``EXL3_MOE_CPU_SPLIT_STATS`` file lists them."""
    return [round(float(c), 3) for c in shares * total]


def profile_total(profile: dict[str, list[float]], real_layer: int) -> float:
    return math.fsum(profile[profile_key(real_layer)])
