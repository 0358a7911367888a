"""A grid of the cache policy's parameters replayed on saved routing traces (CPU), all layers of a step at once.

``cache_policy_sim.replay_decayed`` steps ``cache_policy.ReferenceCache`` one layer at a time: ~6 s for a
1,500-step trace of the full preset on the development VM, too slow for a grid of a hundred settings over seven
traces. :func:`replay` runs the same arithmetic on every layer of a step at once (NumPy over [layers, experts]),
for one-row steps (the sim's traces) only. It is a copy of ``ReferenceCache.step`` for speed, like the kernel is,
and held to the reference in the same way: ``tests/bench/test_cache_policy_grid.py`` checks the hits, admissions
and scores, bit for bit, and ``--check`` does so on the first 200 steps of each trace given.

    python3 -m bench.cache_policy_grid --traces DIR [--check] --out grid.json

``DIR`` holds ``NAME_trace.npy`` (int [steps, layers, top_k]) and ``NAME_profile.npy`` (float [layers, experts],
what the cache places and warm-starts by) per trace; ``--slots NAME=N`` gives a trace's slot count (default: a 24 GB
card's share, as the sim's). The JSON has each trace's hit rate and admissions per layer step for every setting;
Belady's and the online bound's hit rates are ``cache_policy_sim``'s (they do not depend on the setting).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cache_policy_sim import replay_decayed, starting_residents
from glm53.offload.cache import Policy
from glm53.offload.cache_policy import C_ADMITS, C_HITS, popularity_lift, warm_scores

GRID = {"decay": (0.995, 0.998, 0.999), "recency_weight": (100.0, 200.0, 400.0, 800.0), "hysteresis": (1.1, 1.25),
        "warm_horizon": (None, 50.0, 100.0, 200.0, 400.0)}


class Soft(NamedTuple):
    """A soft term added to the fast score, from the router's scores of every expert (``bench.cache_policy_soft``):
    ``g = g * decay + signal[t]`` per step (``g`` starts at 0), and the score becomes ``f + w * (r + weight * g)``
    with ``w`` the layer's recency weight, so the term is off on a layer whose picks do not recur."""

    signal: np.ndarray  # float32 [steps, layers, experts]: each expert's soft pick count of the step
    decay: float
    weight: float


def replay(trace: np.ndarray, start: list[list[int]], profile: np.ndarray, policy: Policy, soft: Soft | None = None,
           record: bool = False) -> dict:
    """``replay_decayed``'s replay of one-row steps (int [steps, layers, top_k], experts in range), every layer at
    once: ``{"hits", "admits"}`` int [layers] and the final ``freq`` / ``recent`` / ``reuse`` float32 arrays.

    :param soft: a soft term in the score (None: the policy's score, bit for bit).
    :param record: also return ``"hit"`` bool [steps, layers, top_k], whether each pick was resident.
    """
    steps, layers, top_k = trace.shape
    experts = profile.shape[1]
    rows = np.arange(layers)
    freq = warm_scores(profile, top_k, policy.decay, policy.warm_horizon)
    recent = warm_scores(profile, top_k, policy.recency_decay, policy.warm_horizon)
    reuse = np.repeat(popularity_lift(profile, top_k)[:, None], 2, axis=1)
    prev = np.zeros((layers, experts), dtype=bool)
    resident = np.zeros((layers, experts), dtype=bool)
    for layer, members in enumerate(start):
        resident[layer, members] = True
    decay, fast, hysteresis = np.float32(policy.decay), np.float32(policy.recency_decay), np.float32(policy.hysteresis)
    keep, weight, one = np.float32(policy.recency_keep), np.float32(policy.recency_weight), np.float32(1)
    hits = np.zeros(layers, dtype=np.int64)
    admits = np.zeros(layers, dtype=np.int64)
    offsets = (rows * experts)[:, None]
    g = np.zeros((layers, experts), dtype=np.float32)
    hit = np.zeros(trace.shape, dtype=bool) if record else None
    for t in range(steps):
        if record:
            hit[t] = np.take_along_axis(resident, trace[t], axis=1)
        count = np.bincount((trace[t] + offsets).reshape(-1), minlength=layers * experts).reshape(layers, experts)
        picked = count > 0
        freq = freq * decay + count.astype(np.float32)  # + 0 leaves an unpicked score as it is
        recent = recent * fast + count.astype(np.float32)
        hits += (count * resident).sum(axis=1)
        n, again, now = prev.sum(axis=1), (picked & prev).sum(axis=1), picked.sum(axis=1)
        measured = (n > 0) & (n < experts)
        lift = again.astype(np.float32) / np.maximum(n, 1).astype(np.float32) - (now - again).astype(np.float32) / np.maximum(experts - n, 1).astype(np.float32)
        reuse[:, 0] = np.where(measured, reuse[:, 0] * keep + (one - keep) * lift, reuse[:, 0])
        prev = picked
        excess = reuse[:, 0] - reuse[:, 1]
        w = (weight * np.where(excess > 0, excess, np.float32(0)))[:, None]
        if soft is None:
            s = freq + w * recent
        else:
            g = g * np.float32(soft.decay) + soft.signal[t]
            s = freq + w * (recent + np.float32(soft.weight) * g)
        candidate, victim = picked & ~resident, ~picked & resident
        active = np.ones(layers, dtype=bool)
        for _ in range(policy.max_admit):
            active &= candidate.any(axis=1) & victim.any(axis=1)
            if not active.any():
                break
            c = np.argmax(np.where(candidate, s, -np.inf), axis=1)
            v = np.argmin(np.where(victim, s, np.inf), axis=1)
            active &= s[rows, c] > hysteresis * s[rows, v]
            at = rows[active]
            resident[at, c[active]], resident[at, v[active]] = True, False
            candidate[at, c[active]], victim[at, v[active]] = False, False
            admits += active
    return {"hits": hits, "admits": admits, "freq": freq, "recent": recent, "reuse": reuse, **({"hit": hit} if record else {})}


def check(trace: np.ndarray, start: list[list[int]], profile: np.ndarray, policy: Policy) -> None:
    """Assert :func:`replay` is ``replay_decayed``, bit for bit (hits and admissions per layer, final scores)."""
    ref = replay_decayed(trace, start, profile, policy)
    got = replay(trace, start, profile, policy)
    assert np.array_equal(got["hits"], ref.counters[:, C_HITS]), "hits differ from the reference"
    assert np.array_equal(got["admits"], ref.counters[:, C_ADMITS]), "admissions differ from the reference"
    for name in ("freq", "recent", "reuse"):
        assert np.array_equal(got[name], getattr(ref, name)), f"{name} differs from the reference"


def settings(grid: dict) -> list[dict]:
    """Every combination of the grid, without the horizons that change nothing (at or beyond ``1 / (1 - decay)``)."""
    out = []
    for values in itertools.product(*grid.values()):
        row = dict(zip(grid, values))
        if row["warm_horizon"] is None or row["warm_horizon"] < 1.0 / (1.0 - row["decay"]):
            out.append(row)
    return out


def choose(result: dict, belady: dict[str, float], baseline: dict, tolerance: float = 0.001) -> dict:
    """The rule for new defaults: the setting with the best mean share of Belady over the presets (traces grouped by
    name without their seed digits: ``engine``, ``random0-2``, ``trained0-2``; each preset the mean of its traces),
    among those that lose at most ``tolerance`` of hit rate against ``baseline`` (today's defaults) on every preset.

    :param belady: Belady's hit rate per trace name.
    :return: ``{"presets": {preset: {setting key: (hit rate, of Belady)}}, "best": setting, "table": rows by score}``.
    """
    presets: dict[str, list[str]] = {}
    for name in result["traces"]:
        presets.setdefault(name.rstrip("0123456789"), []).append(name)
    key = lambda row: tuple((k, row[k]) for k in sorted(row) if k not in ("hit_rate", "admits_per_layer_step"))
    table: dict[tuple, dict] = {}
    for preset, names in presets.items():
        for name in names:
            for run in result["traces"][name]["runs"]:
                cell = table.setdefault(key(run), {}).setdefault(preset, {"hit_rate": [], "of_belady": [], "admits": []})
                cell["hit_rate"].append(run["hit_rate"])
                cell["of_belady"].append(run["hit_rate"] / belady[name])
                cell["admits"].append(run["admits_per_layer_step"])
    rows = []
    for setting, cells in table.items():
        mean = {preset: {k: float(np.mean(v)) for k, v in cell.items()} for preset, cell in cells.items()}
        rows.append({"setting": dict(setting), **{preset: {k: round(v, 4) for k, v in m.items()} for preset, m in mean.items()},
                     "mean_of_belady": round(float(np.mean([m["of_belady"] for m in mean.values()])), 4)})
    base = next(row for row in rows if row["setting"] == {k: baseline[k] for k in row["setting"]})
    for row in rows:
        row["loss_vs_baseline"] = round(max(base[p]["hit_rate"] - row[p]["hit_rate"] for p in presets), 4)
        row["allowed"] = row["loss_vs_baseline"] <= tolerance
    rows.sort(key=lambda row: -row["mean_of_belady"])
    best = max((row for row in rows if row["allowed"]), key=lambda row: row["mean_of_belady"])
    return {"presets": {p: names for p, names in presets.items()}, "baseline": base, "best": best, "table": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.cache_policy_grid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--slots", action="append", default=[], help="NAME=N: the slot count of a trace (default: 1376/12096 of its experts)")
    ap.add_argument("--recency-decay", type=float, action="append", help="grid the fast decay instead (the rest at the defaults)")
    ap.add_argument("--check", action="store_true", help="first hold the replay to the reference on 200 steps of each trace")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    slots = dict(item.split("=") for item in args.slots)
    grid = {"recency_decay": tuple(args.recency_decay)} if args.recency_decay else GRID
    rows = settings(grid) if "warm_horizon" in grid else [dict(zip(grid, v)) for v in itertools.product(*grid.values())]
    result = {"grid": {k: list(v) for k, v in grid.items()}, "traces": {}}
    for path in sorted(args.traces.glob("*_trace.npy")):
        name = path.name[: -len("_trace.npy")]
        trace, profile = np.load(path), np.load(args.traces / f"{name}_profile.npy")
        n = int(slots.get(name, round(1376 / 12096 * profile.size)))
        start = starting_residents(profile, n)
        if args.check:
            check(trace[:200], start, profile, Policy())
        t0 = time.time()
        picks = trace.size
        runs = []
        for row in rows:
            got = replay(trace, start, profile, Policy(**row))
            runs.append({**row, "hit_rate": round(int(got["hits"].sum()) / picks, 4),
                         "admits_per_layer_step": round(int(got["admits"].sum()) / (trace.shape[0] * trace.shape[1]), 3)})
        result["traces"][name] = {"steps": int(trace.shape[0]), "slots": n, "runs": runs}
        print(f"{name}: {len(rows)} settings in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
