"""Does the router's soft score help the GPU expert cache? Replays on the routing twin's traces (CPU), issue 33.

The cache's policy (``cache_policy.ReferenceCache``) sees only each step's top-k picks. A router scores every
expert, and on a trained router the experts it scored high but did not pick at token t are likely picks at t + 1.
This adds a soft term to the policy's score, from the router's scores of all experts of the layer at each step,
and replays it (``cache_policy_grid.replay`` with ``Soft``) against Belady, LRU and the policy without it:

    g = g * soft_decay + signal[t]            per expert, float32 [layers, experts], from 0
    s = f + w * (r + soft_weight * g)         w: the layer's recency weight (zero where picks do not recur)

Admission is unchanged (only a missed pick can be admitted, past the hysteresis), so the term changes which
resident is evicted and which missed pick is admitted, and adds no copies of its own. ``signal`` (``soft_signal``)
is one of, with ``S = sigmoid(z) + bias`` the selection score of logit ``z`` and ``S_k`` the step's k-th best:

- ``rank``: 1 for the experts ranked ``top_k .. knob - 1`` by ``S`` (the near misses), 0 otherwise;
- ``margin``: ``sigmoid((S - S_k) / knob)`` for every expert (about 1 for the picks, 0 far below the cut);
- ``predict``: each expert's expected picks over the next ``knob`` steps if the logits are AR(1) over tokens with
  the layer's lag-1 correlation ``rho`` and spread ``sigma``: the sum over ``n = 1 .. knob`` of
  ``Phi((rho^n z - theta) / (sigma sqrt(1 - rho^2n)))``, ``theta`` the logit at which ``S`` reaches the layer's
  mean k-th score. ``rho``, ``sigma`` and the mean k-th score are measured on the trace's logits (a kernel would
  keep running means of them per layer).

``gap`` splits Belady's hits over the policy's by how long ago the expert was last picked and by its router rank
at the step before: what online information could recover.

    python3 -m bench.cache_policy_soft --routing trained --seed 0 --steps 1500 [--grid small] --out soft.json
    python3 -m bench.cache_policy_soft --engine-trace picks.npy logits.npz [--synth-preset scaled --slots 384] --out soft.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cache_policy_grid import Soft, replay
from bench.cache_policy_sim import (online_bound, pick_probabilities, run_belady, run_lru, run_static_by, run_static_hindsight,
                                    starting_residents)
from glm53.offload.cache import Policy
from glm53.tools.synth.routing import top_picks

SHARE = 1376 / 12096  # a 24 GB card's
BASES = {"defaults": Policy(), "candidate": Policy(decay=0.999, recency_weight=400.0, hysteresis=1.1, warm_horizon=200.0)}
GRIDS = {
    "small": {"kind": [("rank", 16), ("margin", 0.02), ("predict", 1)], "soft_decay": [0.0, 0.5], "soft_weight": [0.5, 2.0]},
    "full": {"kind": [("rank", 16), ("rank", 32), ("margin", 0.02), ("predict", 1), ("predict", 4)],
             "soft_decay": [0.0, 0.5], "soft_weight": [1.0, 2.0, 4.0, 8.0, 16.0]},
}
REUSE_CLASSES = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 10**9))  # steps since the expert's last pick at the layer


def selection_scores(logits: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """float32 [steps, layers, experts] ``sigmoid(z) + bias`` (``routing.top_picks``' score) of logits [steps,
    layers, experts] and biases [layers, experts]."""
    return (1.0 / (1.0 + np.exp(-logits.astype(np.float32))) + biases[None].astype(np.float32)).astype(np.float32)


def kth_score(score: np.ndarray, top_k: int) -> np.ndarray:
    """float32 [steps, layers, 1]: each step's k-th best selection score (the last pick's)."""
    return -np.partition(-score, top_k - 1, axis=-1)[..., top_k - 1: top_k]


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """The standard normal CDF, by Abramowitz and Stegun's erf 7.1.26 (absolute error below 1.5e-7), as a kernel
    would compute it (one exp per expert; NumPy has no erf and SciPy is not a dependency)."""
    u = np.abs(x) / np.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * u)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-u * u)
    return 0.5 * (1.0 + np.sign(x) * erf)


def soft_signal(logits: np.ndarray, biases: np.ndarray, top_k: int, kind: str, knob: float) -> np.ndarray:
    """float32 [steps, layers, experts]: each expert's soft pick count of each step (module docstring).

    :param logits: float32 [steps, layers, experts] the router's logits; ``biases`` float32 [layers, experts].
    :raise ValueError: an unknown kind.
    """
    score = selection_scores(logits, biases)
    kth = kth_score(score, top_k)
    if kind == "rank":
        ranks = np.argsort(np.argsort(-score, axis=-1, kind="stable"), axis=-1, kind="stable")
        return ((ranks >= top_k) & (ranks < int(knob))).astype(np.float32)
    if kind == "margin":
        return (1.0 / (1.0 + np.exp(-(score - kth) / np.float32(knob)))).astype(np.float32)
    if kind == "predict":
        z = logits.astype(np.float64)
        sigma = np.sqrt((z**2).mean(axis=(0, 2)))  # [layers]
        rho = (z[1:] * z[:-1]).mean(axis=(0, 2)) / sigma**2
        cut = np.clip(kth.mean(axis=(0, 2))[:, None] - biases, 1e-6, 1 - 1e-6)  # [layers, experts], in sigmoid units
        theta = np.log(cut / (1 - cut))
        out = np.zeros(z.shape)
        for k in range(1, max(int(knob), 1) + 1):  # the chances of a pick at t + 1 .. t + knob, summed
            lag = (rho**k)[:, None]
            spread = (sigma[:, None] * np.sqrt(np.maximum(1 - lag**2, 1e-6)))
            out += normal_cdf((lag * z - theta) / spread)
        return out.astype(np.float32)
    raise ValueError(f"unknown soft signal {kind!r}; choose rank, margin or predict")


def online_ceiling(twin, logits: np.ndarray, start: list[list[int]], samples: int = 128, seed: int = 0) -> dict:
    """The best expected hit rate any online policy of per-layer slots can have on a twin with dynamics (``trained``),
    the analogue of ``cache_policy_sim.online_bound`` for picks that recur.

    A layer's routing state is AR(1) over tokens and its logits determine it (``z = sigma M x``, ``M`` of full
    column rank), so given everything up to token t, ``x[t + 1] ~ N(rho x[t], (1 - rho^2) I)`` and the chance ``P``
    that expert ``e`` is picked at t + 1 is a function of ``z[t]`` alone. The residents at t + 1 are chosen by
    then, so a step's expected hits are at most the sum of ``P`` over the layer's ``q`` most likely experts, even
    for a policy that may copy in any expert (this cache admits only missed picks). ``P`` is estimated from
    ``samples`` draws of ``x[t + 1]`` per step: ``upper`` picks the set and sums ``P`` on the same draws (biased up,
    a ceiling), ``lower`` picks it on half and sums on the other half (a set an online policy could hold, so not a
    ceiling; the truth is between the two). Steps 1 .. end, over their picks.

    :param logits: float32 [steps, layers, experts] the trace's (``TwinTrace.logits``).
    """
    rng = np.random.default_rng([seed, 34])
    rho, top_k = np.float32(twin.dynamics.temporal), twin.top_k
    upper = lower = 0.0
    for i, members in enumerate(start):
        m = np.float32(twin.sigma) * twin.directions[i]  # [experts, rank]
        x = np.linalg.lstsq(m, logits[:-1, i].T, rcond=None)[0].T.astype(np.float32)  # [steps - 1, rank]
        noise = rng.standard_normal((samples, *x.shape), dtype=np.float32)
        ahead = rho * x[None] + np.sqrt(np.float32(1) - rho * rho) * noise  # [samples, steps - 1, rank]
        picked = np.zeros((samples, x.shape[0], twin.experts), dtype=np.float32)
        np.put_along_axis(picked, top_picks(ahead @ m.T, twin.biases[i], top_k), 1.0, axis=2)
        q = len(members)
        half = samples // 2
        p_all, p_a, p_b = picked.mean(axis=0), picked[:half].mean(axis=0), picked[half:].mean(axis=0)
        upper += float(-np.partition(-p_all, q - 1, axis=1)[:, :q].sum())
        chosen = np.argsort(-p_a, axis=1, kind="stable")[:, :q]
        lower += float(np.take_along_axis(p_b, chosen, axis=1).sum())
    picks = (logits.shape[0] - 1) * len(start) * top_k
    return {"upper": round(upper / picks, 4), "lower": round(lower / picks, 4), "samples": samples}


def reuse_distance(trace: np.ndarray) -> np.ndarray:
    """int64 [steps, layers, top_k]: steps since the layer last picked each pick's expert; 0 for its first pick."""
    steps, layers, top_k = trace.shape
    last = np.full((layers, int(trace.max()) + 1), -1, dtype=np.int64)
    rows = np.arange(layers)[:, None]
    out = np.zeros(trace.shape, dtype=np.int64)
    for t in range(steps):
        before = last[rows, trace[t]]
        out[t] = np.where(before >= 0, t - before, 0)
        last[rows, trace[t]] = t
    return out


def gap(trace: np.ndarray, policy_hit: np.ndarray, belady_hit: np.ndarray, score: np.ndarray) -> dict:
    """Belady's hit rate over the policy's, split by class of pick (each class's share of all picks, of the
    policy's misses, and of the gap): by reuse distance (``first``: never picked before in the trace), and by the
    expert's router rank at the layer's step before (``prev_rank_9_16``: a near miss then)."""
    picks = trace.size
    distance = reuse_distance(trace)
    ranks = np.argsort(np.argsort(-score, axis=-1, kind="stable"), axis=-1, kind="stable")  # [steps, layers, experts]
    prev_rank = np.full(trace.shape, 10**6, dtype=np.int64)
    prev_rank[1:] = np.take_along_axis(ranks[:-1], trace[1:], axis=2)
    top_k = trace.shape[2]
    classes = {"first": distance == 0}
    for low, high in REUSE_CLASSES:
        classes[f"reuse_{low}_{high}" if high < 10**9 else f"reuse_{low}_plus"] = (distance >= low) & (distance <= high)
    classes["prev_rank_1_8"] = prev_rank < top_k
    classes["prev_rank_9_16"] = (prev_rank >= top_k) & (prev_rank < 2 * top_k)
    classes["prev_rank_17_32"] = (prev_rank >= 2 * top_k) & (prev_rank < 4 * top_k)
    classes["prev_rank_33_plus"] = (prev_rank >= 4 * top_k) & (prev_rank < 10**6)
    total = int(belady_hit.sum()) - int(policy_hit.sum())
    out = {"gap_hit_rate": round(total / picks, 4)}
    for name, where in classes.items():
        b, p = int(belady_hit[where].sum()), int(policy_hit[where].sum())
        out[name] = {"share_of_picks": round(float(where.sum()) / picks, 4), "policy_hit": round(p / max(int(where.sum()), 1), 4),
                     "belady_hit": round(b / max(int(where.sum()), 1), 4), "share_of_gap": round((b - p) / max(total, 1), 3)}
    return out


def grid_rows(name: str) -> list[dict]:
    grid = GRIDS[name]
    return [{"base": base, "kind": kind, "knob": knob, "soft_decay": d, "soft_weight": w}
            for base in BASES for (kind, knob), d, w in itertools.product(grid["kind"], grid["soft_decay"], grid["soft_weight"])]


def replay_one(trace, start, profile, row: dict, signals: dict, record: bool = False) -> dict:
    """One setting's replay: hit rate, admissions per layer step (and the hit flags with ``record``)."""
    soft = None if row["kind"] is None else Soft(signals[(row["kind"], row["knob"])], row["soft_decay"], row["soft_weight"])
    got = replay(trace, start, profile, BASES[row["base"]], soft, record)
    out = {**row, "hit_rate": round(int(got["hits"].sum()) / trace.size, 4),
           "admits_per_layer_step": round(int(got["admits"].sum()) / (trace.shape[0] * trace.shape[1]), 3)}
    return {**out, "hit": got["hit"]} if record else out


def run(routing: str, seed: int, steps: int, grid: str, ceiling: int = 0) -> dict:
    """Every setting of ``grid`` on the full preset's twin (``routing``, ``seed``), with the references (and
    ``online_ceiling`` from ``ceiling`` draws per step, ``trained`` only; 0: not computed)."""
    from bench.routing_stats import twin_from_settings

    twin, profile = twin_from_settings("full", routing, seed, None)
    traced = twin.run(steps, seed)  # the trace of cache_policy_sim.twin_trace
    trace, logits = traced.picks, traced.logits
    start = starting_residents(profile, round(SHARE * profile.size))
    extra = {"static_true": run_static_by(trace, start, pick_probabilities(twin, 50_000, seed)) / trace.size}
    if ceiling and twin.dynamics is not None:
        got = online_ceiling(twin, logits, start, ceiling, seed)
        extra["prefetch_ceiling"], extra["prefetch_online"] = got["upper"], got["lower"]
    out = replay_grid(trace, logits, np.stack(twin.biases), start, profile, grid, iid=routing == "random", extra=extra,
                      label=f"{routing} seed {seed}")
    return {"routing": routing, "seed": seed, "steps": steps, **out}


def run_recorded(picks: np.ndarray, router: dict, preset: str, slots: int, grid: str) -> dict:
    """Every setting of ``grid`` on a trace the real engine recorded (``bench.routing_stats --engine --trace-out
    --logits-out``) on a ``glm53 synth --preset`` checkpoint, placed and warm-started by the profile it ships, as the
    engine was, with ``slots`` cache slots in all.

    :raise ValueError: logits that are not the trace's steps and layers."""
    from bench.cache_policy_sim import synth_profile

    logits, biases = np.asarray(router["logits"], np.float32), np.asarray(router["biases"], np.float32)
    if logits.shape[:2] != picks.shape[:2] or biases.shape != (picks.shape[1], logits.shape[2]):
        raise ValueError(f"logits {logits.shape} and biases {biases.shape} do not match the trace's {picks.shape[:2]} "
                         f"steps and layers (record both in one bench.routing_stats --engine run)")
    profile = synth_profile(preset, picks.shape[1])
    start = starting_residents(profile, slots)
    out = replay_grid(picks, logits, biases, start, profile, grid, iid=False,
                      extra={"static_hindsight": run_static_hindsight(picks, start) / picks.size}, label="engine trace")
    return {"trace": "engine", "synth_preset": preset, "steps": int(picks.shape[0]), **out}


def replay_grid(trace, logits, biases, start, profile, grid: str, iid: bool, extra: dict, label: str) -> dict:
    """The references (Belady, LRU and ``extra``'s hit rates), the policy's bases without the soft term and every
    setting of ``grid`` with it, each as a share of Belady and of the online bound (a bound only where ``iid``), and
    the split of Belady's gap for the bases and the best setting."""
    rows = grid_rows(grid)
    top_k = trace.shape[2]
    kinds = {(row["kind"], row["knob"]) for row in rows}
    signals = {k: soft_signal(logits, biases, top_k, *k) for k in kinds}
    belady_hit = np.zeros(trace.shape, dtype=bool)
    hit_rate = {"belady": run_belady(trace, start, hit=belady_hit) / trace.size, "lru": run_lru(trace, start) / trace.size,
                **extra}
    bound = online_bound({k: round(v, 4) for k, v in hit_rate.items()}, iid=iid)
    runs = []
    for base in BASES:
        runs.append(replay_one(trace, start, profile, {"base": base, "kind": None, "knob": None, "soft_decay": None,
                                                       "soft_weight": None}, signals, record=True))
    t0 = time.time()
    runs += [replay_one(trace, start, profile, row, signals) for row in rows]
    print(f"{label}: {len(rows)} settings in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    for r in runs:
        r["of_belady"] = round(r["hit_rate"] / hit_rate["belady"], 4)
        r["of_online_bound"] = round(r["hit_rate"] / bound["hit_rate"], 4)
    best = max(runs, key=lambda r: r["hit_rate"])
    best_hit = replay_one(trace, start, profile, best, signals, record=True)["hit"] if best["kind"] else None
    score = selection_scores(logits, biases)
    gaps = {r["base"]: gap(trace, r.pop("hit"), belady_hit, score) for r in runs[: len(BASES)]}
    if best_hit is not None:
        gaps["best_soft"] = gap(trace, best_hit, belady_hit, score)
    return {"slots": int(sum(map(len, start))), "hit_rate": {k: round(v, 4) for k, v in hit_rate.items()}, "online_bound": bound,
            "of_belady": {k: round(v / hit_rate["belady"], 4) for k, v in hit_rate.items()}, "runs": runs,
            "best": {k: v for k, v in best.items()}, "gap": gaps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.cache_policy_soft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--routing", choices=("random", "trained"), default="trained")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--grid", choices=tuple(GRIDS), default="small")
    ap.add_argument("--ceiling", type=int, default=0, help="draws per step for online_ceiling (trained; 0: skip it)")
    ap.add_argument("--engine-trace", nargs=2, type=Path, metavar=("PICKS_NPY", "LOGITS_NPZ"),
                    help="replay a trace the engine recorded (bench.routing_stats --engine --trace-out --logits-out) instead")
    ap.add_argument("--synth-preset", default="scaled", help="with --engine-trace: the preset of the checkpoint it ran")
    ap.add_argument("--slots", type=int, default=384, help="with --engine-trace: the cache's slots in all (the engine's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.engine_trace:
        picks, logits = args.engine_trace
        result = run_recorded(np.load(picks), dict(np.load(logits)), args.synth_preset, args.slots, args.grid)
    else:
        result = run(args.routing, args.seed, args.steps, args.grid, args.ceiling)
    result["command"] = "python3 -m bench.cache_policy_soft " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    top = sorted(result["runs"], key=lambda r: -r["hit_rate"])[:5]
    print(json.dumps({"hit_rate": result["hit_rate"], "top": top}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
