"""Predictive prefetch of routed experts (issue 20), replayed on synthetic routing traces on the CPU: what copying
each layer's predicted experts into a prefetch pool during its attention would save, by how good the prediction is
and by how the VRAM is split between the cache and the pools. The policy is ``glm53/offload/prefetch_policy.py``'s,
beside the cache's unchanged ``ReferenceCache`` step; traces and profile come from ``bench/cache_policy_sim.py``.

Predictors, per layer and step:

- ``none``: no prefetch, the cache alone (exact decode today);
- ``oracle``: the true picks of the step, the machinery's ceiling whatever the predictor;
- ``recall R``: each true pick kept with probability R, the list filled to ``top_k + extra`` with false positives
  drawn from the profile's shares (never a true pick), in random order (a real predictor ranks its list, which the
  pool's fill order uses; random order is the pessimistic end).

The step time model (constants on the command line, defaults measured on the H200 host with the 12-MoE-layer
``scaled`` checkpoint, 32 of 288 experts per layer cached): ``T_fix`` is everything but reading misses (attention,
dense layers, shared experts, hits, head). Serial: ``T_fix + link bytes / link``, link bytes the misses' and the
prefetch copies'. Overlapped: the copies run during the attention window of their layer (``--window-ms``, by
default ``T_fix`` spread evenly over the scaled checkpoint's 12 MoE layers, the optimistic end that the overlap bound
``max(T_fix, misses / link)`` also assumes), so ``T_fix + miss bytes / link + the copies' bytes past the window``;
the policy issues only the whole experts that fit the window, so nothing is past it, and a prefetch saves exactly
the misses it turns into prefetch hits. The trade: at a fixed total of slots, the pools' slots
(``pool x buffers``: one pool every layer uses in turn, or one per layer) come out of the cache.

NOT measured here: how good a real predictor is. The synthetic traces draw every layer independently (iid from the
profile, or with a slow drift per expert), with no correlation between layers, so no predictor can be derived from
them; the recall of scoring layer l+1's router on an earlier hidden state must be measured on the GPU with the real
model. The oracle row separates the machinery's ceiling from the predictor's quality.

    python3 -m bench.prefetch_sim [--steps 1000] [--layers 12] [--share 0.111] [--out prefetch.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cache_policy_sim import PROFILE, load_profile, make_trace
from bench.output import emit_json
from glm53.offload.cache import Policy
from glm53.offload.cache_policy import shares
from glm53.offload.prefetch_policy import (
    P_COPIED_EXPERTS,
    P_HITS,
    P_MISS_EXPERTS,
    P_PICKS,
    P_PREFETCH_HITS,
    P_WASTED_EXPERTS,
    Split,
    budget_experts,
    replay,
)

MEASURED_MISS_MB = 608.0  # per decode step on the H200 host, scaled checkpoint, 32/288 cached (exact mode)
MEASURED_LAYERS = 12  # the scaled checkpoint's MoE layers, over which T_fix was measured


def noisy_predictions(trace: np.ndarray, profile: np.ndarray, recall: float, width: int, seed: int) -> np.ndarray:
    """int [steps, layers, width]: per layer step, each true pick kept with probability ``recall``, then false
    positives drawn from the profile's shares (Gumbel top, true picks excluded) up to ``width``, shuffled.

    :param trace: int [steps, layers, top_k] distinct true picks per layer step; ``width >= top_k``.
    """
    steps, layers, top_k = trace.shape
    experts = profile.shape[1]
    if not top_k <= width <= experts:
        raise ValueError(f"a prediction of {width} experts for top-{top_k} of {experts}")
    rng = np.random.default_rng([seed, int(round(recall * 1000))])
    keep = rng.random(trace.shape) < recall  # [S, L, k]
    keys = np.log(np.maximum(shares(profile), 1e-12))[None] + rng.gumbel(size=(steps, layers, experts))
    np.put_along_axis(keys, trace, -np.inf, axis=2)  # a false positive is never a true pick
    false = np.argsort(-keys, axis=2, kind="stable")[:, :, :width]  # [S, L, width]
    kept_first = np.take_along_axis(trace, np.argsort(~keep, axis=2, kind="stable"), axis=2)
    kept = keep.sum(axis=2, keepdims=True)  # [S, L, 1]
    j = np.arange(width)[None, None, :]
    pool = np.concatenate([kept_first, false], axis=2)
    pred = np.take_along_axis(pool, np.where(j < kept, np.minimum(j, top_k - 1), top_k + j - kept), axis=2)
    return np.take_along_axis(pred, np.argsort(rng.random(pred.shape), axis=2), axis=2)


def measured_recall(trace: np.ndarray, pred: np.ndarray) -> float:
    """The share of true picks that are in their layer step's prediction."""
    return float((trace[..., :, None] == pred[..., None, :]).any(axis=-1).mean())


def run_config(trace, profile, split: Split, pred, consts: dict, policy: Policy) -> dict:
    """One replay and its modelled step time. ``pred``: int [steps, layers, n] or None (no prefetch)."""
    predict = None if pred is None else (lambda t, layer: pred[t, layer][None, :])
    run = replay(trace, profile, split, predict, consts["budget_bytes"], consts["expert_bytes"],
                 policy.decay, policy.hysteresis, policy.max_admit, policy.recency)
    c = run.counters.sum(axis=0)
    steps, layers = trace.shape[:2]
    mb = consts["expert_bytes"] / 1e6 / steps  # MB per step of one expert per replay
    miss_mb, copy_mb = c[P_MISS_EXPERTS] * mb, c[P_COPIED_EXPERTS] * mb
    hidden_mb = min(copy_mb, layers * consts["window_ms"] * consts["link_gbs"])  # what a step's windows carry
    serial = consts["t_fix_ms"] + (miss_mb + copy_mb) / consts["link_gbs"]  # MB / (GB/s) = ms
    overlapped = consts["t_fix_ms"] + (miss_mb + copy_mb - hidden_mb) / consts["link_gbs"]
    return {
        "pool": split.pool, "buffers": split.buffers, "cache_slots": split.cache_slots,
        "hit_rate": round(c[P_HITS] / c[P_PICKS], 4),
        "prefetch_hit_rate": round(c[P_PREFETCH_HITS] / c[P_PICKS], 4),
        "miss_rate": round(1 - (c[P_HITS] + c[P_PREFETCH_HITS]) / c[P_PICKS], 4),
        "copies_per_step": round(c[P_COPIED_EXPERTS] / steps, 2),
        "wasted_mb_per_step": round(c[P_WASTED_EXPERTS] * mb, 1),
        "miss_mb_per_step": round(miss_mb, 1),
        "link_mb_per_step": round(miss_mb + copy_mb, 1),
        "serial_ms": round(serial, 3), "overlapped_ms": round(overlapped, 3),
        "serial_tok_s": round(1000 / serial, 1), "overlapped_tok_s": round(1000 / overlapped, 1),
    }


def twin_router(layers: int, steps: int, extra: int, routing: str, seed: int):
    """(profile, trace, router predictions int [steps, layers, top_k + extra]) of the scaled checkpoint's routing twin
    with ``layers`` MoE layers: each layer's prediction is its gate on the previous layer's routing state, the first
    layer's its previous step's picks (what the device's lead prefetches), none at the first step (-1: no expert)."""
    from bench.routing_stats import twin_from_settings, twin_trace

    twin, shares = twin_from_settings("scaled", routing, seed, layers)
    trace, guesses = twin_trace(twin, steps, seed)
    top_k = trace.shape[2]
    if top_k + extra > guesses.shape[2]:
        raise ValueError(f"the twin's router guesses {guesses.shape[2]} experts, not {top_k + extra}")
    first = np.full((steps, 1, top_k + extra), -1, dtype=np.int64)
    first[1:, 0, :top_k] = trace[:-1, 0]
    return shares, trace, np.concatenate([first, guesses[:, :, : top_k + extra]], axis=1)


def simulate(profile, trace, total: int, consts: dict, recalls, extra: int, pool: int, buffers: int, seed: int,
             policy: Policy | None = None, router=None) -> list[dict]:
    """Every configuration on one trace: none, oracle, the router's prediction when given (int [steps, layers, n]),
    each recall at (``pool``, ``buffers``), then the trade of cache slots for pool slots at the same total (oracle
    and the middle recall; pools of 1, 2 and 4 slots, one pool or one per layer). Speedups are against ``none``'s
    step."""
    policy = policy or Policy()
    layers, top_k = trace.shape[1], trace.shape[2]
    preds = {"oracle": trace, **({} if router is None else {"router": router}),
             **{f"recall {r:g}": noisy_predictions(trace, profile, r, top_k + extra, seed) for r in recalls}}
    rows = [{"predictor": "none", **run_config(trace, profile, Split(total), None, consts, policy)}]
    for name, pred in preds.items():
        rows.append({"predictor": name, **run_config(trace, profile, Split(total, pool, buffers), pred, consts, policy)})
    trade_for = ["oracle"] + ([f"recall {recalls[len(recalls) // 2]:g}"] if recalls else [])
    for name in trade_for:
        for n_buffers in sorted({1, layers}):
            for n_pool in (1, 2, 4):
                if (n_pool, n_buffers) != (pool, buffers) and n_pool * n_buffers <= total:
                    row = run_config(trace, profile, Split(total, n_pool, n_buffers), preds[name], consts, policy)
                    rows.append({"predictor": name, "trade": True, **row})
    for row in rows:
        pred = preds.get(row["predictor"])
        row["measured_recall"] = None if pred is None else round(measured_recall(trace, pred), 4)
        row["speedup"] = round(rows[0]["serial_ms"] / row["overlapped_ms"], 3)
    return rows


COLUMNS = {  # table heading: result key
    "pool": "pool", "bufs": "buffers", "cache": "cache_slots", "recall": "measured_recall", "hit": "hit_rate",
    "pf hit": "prefetch_hit_rate", "waste MB": "wasted_mb_per_step", "link MB": "link_mb_per_step",
    "serial ms": "serial_ms", "overlap ms": "overlapped_ms", "tok/s": "overlapped_tok_s", "speedup": "speedup",
}


def table(rows: list[dict]) -> str:
    """One line per configuration; per decode step: MB wasted by copies no row picked, MB over the link."""
    lines = [f"{'predictor':<13}" + "".join(f"{h:>11}" for h in COLUMNS)]
    for row in rows:
        label = row["predictor"] + (" *" if row.get("trade") else "")
        lines.append(f"{label:<13}" + "".join(f"{'-' if row[k] is None else row[k]:>11}" for k in COLUMNS.values()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.prefetch_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=PROFILE)
    ap.add_argument("--layers", type=int, default=12, help="the profile's first N MoE layers (default: the scaled checkpoint's 12)")
    ap.add_argument("--share", type=float, default=32 / 288, help="VRAM slots as a share of all experts, cache and pools together")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--modes", default="iid,drift", help="traces: iid, drift (from the profile), twin-random, "
                                                          "twin-trained (the scaled checkpoint's routing twin, with "
                                                          "its router's predictions)")
    ap.add_argument("--recalls", default="0.5,0.7,0.9")
    ap.add_argument("--extra", type=int, default=0, help="predicted experts beyond top-k")
    ap.add_argument("--pool", type=int, help="prefetch slots per layer step (default: what the window's link budget carries)")
    ap.add_argument("--buffers", type=int, default=1, help="pools at once (1: every layer uses one in turn)")
    ap.add_argument("--t-fix-ms", type=float, default=5.10, help="step time without the misses' reads (H200, scaled)")
    ap.add_argument("--link-gbs", type=float, default=50.2, help="host link read rate, GB/s (H200 host)")
    ap.add_argument("--expert-mb", type=float, default=9.47, help="one expert's bytes in EXL3, MB")
    ap.add_argument("--window-ms", type=float, help="attention window per MoE layer (default: T_fix / 12, the scaled checkpoint's MoE layers)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the result as JSON")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)[: args.layers]
    window_ms = args.window_ms if args.window_ms is not None else args.t_fix_ms / MEASURED_LAYERS
    consts = {"t_fix_ms": args.t_fix_ms, "link_gbs": args.link_gbs, "expert_bytes": round(args.expert_mb * 1e6),
              "window_ms": window_ms, "budget_bytes": round(window_ms * 1e-3 * args.link_gbs * 1e9)}
    fits = budget_experts(consts["budget_bytes"], consts["expert_bytes"])
    pool = fits if args.pool is None else args.pool
    total = round(args.share * profile.size)
    recalls = [float(r) for r in args.recalls.split(",") if r]
    result = {
        "model": {**consts, "window_fits_experts": fits, "layers": profile.shape[0], "experts": profile.shape[1],
                  "total_slots": total, "top_k": args.top_k, "extra": args.extra, "steps": args.steps,
                  "seed": args.seed, "profile": str(args.profile), "measured_miss_mb_per_step": MEASURED_MISS_MB},
        "caveat": "iid and drift traces have no cross-layer correlation; the twins' router is the synthetic routing's, "
                  "not the real network's: real predictor recall must be measured on the GPU",
        "modes": {},
    }
    print(f"T_fix {args.t_fix_ms} ms, link {args.link_gbs} GB/s, expert {args.expert_mb} MB, window {window_ms:.3f} ms "
          f"per layer ({fits} experts), {profile.shape[0]} layers, {total} slots; pool {pool} x {args.buffers}; "
          f"measured without prefetch: {MEASURED_MISS_MB:g} MB of misses per step. * = the slot trade")
    for mode in args.modes.split(","):
        shares, router = profile, None
        if mode.startswith("twin-"):
            shares, trace, router = twin_router(args.layers, args.steps, args.extra, mode[len("twin-"):], args.seed)
        else:
            trace = make_trace(profile, args.steps, args.top_k, mode, args.seed)
        rows = simulate(shares, trace, total, consts, recalls, args.extra, pool, args.buffers, args.seed, router=router)
        bound = max(args.t_fix_ms, rows[0]["miss_mb_per_step"] / args.link_gbs)
        result["modes"][mode] = {"overlap_bound_ms": round(bound, 3), "runs": rows}
        print(f"\n{mode} (overlap bound max(T_fix, misses / link) = {bound:.2f} ms):\n{table(rows)}")
    if args.out:
        emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
