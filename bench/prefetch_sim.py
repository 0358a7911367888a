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

Calibration of the threshold on the predicted score (``--calibrate trained,random``, ``GLM53_PREFETCH_MIN_SCORE``):
on each preset's routing twin, layer ``l + 1``'s gate on layer ``l``'s routing state scores its experts as the
device does; the precision of those predictions by rank and by score bucket is measured against the true picks;
the break-even chance is the overrun of the copy that straddles the window's end over one miss's link time
(``break_even``, with the measured window and copy rate); the threshold is the lowest score from which every
bucket's precision clears it, checked by replaying the pool at thresholds around it (``modelled_gain``).

    python3 -m bench.prefetch_sim [--steps 1000] [--layers 12] [--share 0.111] [--out prefetch.json]
    python3 -m bench.prefetch_sim --calibrate trained,random [--steps 2000] [--out threshold.json]
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
from glm53.offload.cache_policy import ReferenceCache, shares
from glm53.offload.prefetch_policy import (
    P_COPIED_EXPERTS,
    P_HITS,
    P_MISS_EXPERTS,
    P_PICKS,
    P_PREFETCH_HITS,
    P_WASTED_EXPERTS,
    PrefetchReplay,
    Split,
    budget_copies,
    budget_experts,
    prediction,
    replay,
)

MEASURED_MISS_MB = 608.0  # per decode step on the H200 host, scaled checkpoint, 32/288 cached (exact mode)
MEASURED_LAYERS = 12  # the scaled checkpoint's MoE layers, over which T_fix was measured
# bench.moe_profile on the H200 host, exact mode, scaled checkpoint (bench/results/2026-12-01-moe-profile-windows-h200.json):
# the link's idle time from one MoE layer's end to the next one's routing (the copies' window)
MEASURED_GAP_MS = 0.1319
# prefetch's own copies on that host: two experts' copies took 344 us (bench/results/2026-12-02-routing-trained-h200.md)
MEASURED_COPY_GBS = 55.0


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
                 policy.decay, policy.hysteresis, policy.max_admit, policy.recency, warm_horizon=policy.warm_horizon)
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


def twin_scored(preset: str, layers: int, steps: int, width: int, seed: int):
    """(profile float [layers, experts], trace int [steps, layers, top_k], predictions int [steps, layers - 1, width], their float32 scores):
    the scaled checkpoint's routing twin of ``preset``, each layer ``l + 1`` predicted by its gate on layer ``l``'s
    routing state (``sigmoid(logit) + bias``, best first, as the device's prediction is made)."""
    from bench.routing_stats import twin_from_settings

    twin, profile = twin_from_settings("scaled", preset, seed, layers)
    run = twin.run(steps, seed)
    made = [prediction(run.next_logits[:, i], twin.biases[i + 1], width, 0) for i in range(run.next_logits.shape[1])]
    return profile, run.picks, np.stack([m[0] for m in made], axis=1), np.stack([m[1] for m in made], axis=1)


def break_even(consts: dict) -> dict:
    """The cost of the copy that straddles the window's end (``budget_copies``' last) against one miss's link time:
    a copy pays when its chance of being picked is above ``chance`` (``overrun / miss``). A copy that ends inside
    the window costs nothing (``chance`` 0 when the copies fill the window exactly)."""
    copy_us = consts["expert_bytes"] / (consts["copy_gbs"] * 1e3)
    miss_us = consts["expert_bytes"] / (consts["link_gbs"] * 1e3)
    window_us = consts["window_ms"] * 1e3
    copies = budget_copies(window_us * 1e-6, consts["copy_gbs"], consts["expert_bytes"])
    overrun_us = max(0.0, copies * copy_us - window_us)
    return {"copies": copies, "copy_us": round(copy_us, 1), "miss_us": round(miss_us, 1), "window_us": window_us,
            "overrun_us": round(overrun_us, 1), "chance": round(overrun_us / miss_us, 4)}


def precision_table(truth: np.ndarray, pred: np.ndarray, scores: np.ndarray, bucket: float, min_count: int) -> dict:
    """Precision (the share of predicted entries the routing picked) by rank in the prediction and by score bucket
    (``[lo, lo + bucket)``, buckets of fewer than ``min_count`` entries left out).

    :param truth: int [steps, layers, top_k]; ``pred``, ``scores``: [steps, layers, n] for the same layers."""
    picked = (pred[..., :, None] == truth[..., None, :]).any(axis=-1)  # [S, L, n]
    by_rank = [round(float(picked[..., r].mean()), 4) for r in range(pred.shape[-1])]
    lo = np.floor(scores / bucket).astype(np.int64).reshape(-1)
    hits = picked.reshape(-1)
    rows = []
    for b in np.unique(lo):
        mask = lo == b
        if mask.sum() >= min_count:
            rows.append({"score_from": round(float(b * bucket), 6), "entries": int(mask.sum()),
                         "precision": round(float(hits[mask].mean()), 4)})
    return {"by_rank": by_rank, "by_score": rows}


def threshold_for(by_score: list[dict], chance: float) -> float | None:
    """The lowest bucket start from which every bucket's precision is at least ``chance`` (None: not even the top
    bucket's). Every bucket above, not the first that crosses: precision is not monotonic in a noisy bucket."""
    found = None
    for row in reversed(by_score):
        if row["precision"] < chance:
            break
        found = row["score_from"]
    return found


def modelled_gain(profile, trace, pred, scores, min_score, consts: dict, total: int, policy: Policy) -> dict:
    """The prefetch replayed with ``min_score`` (None: every prediction) and ``budget_copies``' pool, layers 1 on
    (layer 0 is the lead's), on the twin's trace; per decode step the link time the used copies saved and the stall
    of every plan's copies past the window: ``gain = used x miss - sum(max(0, copies x copy - window))``."""
    be = break_even(consts)
    split = Split(total, be["copies"], 1)
    top_k = trace.shape[2]
    cache = ReferenceCache.warm(profile, split.cache_slots, top_k, policy.decay, policy.recency, policy.warm_horizon)
    run = PrefetchReplay(cache, split.pool, be["copies"] * consts["expert_bytes"], consts["expert_bytes"], policy.decay,
                         policy.hysteresis, policy.max_admit, policy.recency, min_score)
    stall_us = 0.0
    for t in range(trace.shape[0]):
        for layer in range(trace.shape[1]):
            if layer == 0:
                run.step(0, trace[t, 0], None)
                continue
            copied = run.step(layer, trace[t, layer], pred[t, layer - 1][None, :], scores[t, layer - 1][None, :])
            stall_us += max(0.0, len(copied) * be["copy_us"] - be["window_us"])
    c = run.counters.sum(axis=0)
    used = int(c[P_COPIED_EXPERTS] - c[P_WASTED_EXPERTS])
    steps = trace.shape[0]
    return {"min_score": min_score, "copies_per_step": round(c[P_COPIED_EXPERTS] / steps, 3),
            "precision": round(used / c[P_COPIED_EXPERTS], 4) if c[P_COPIED_EXPERTS] else None,
            "saved_us_per_step": round(used * be["miss_us"] / steps, 1), "stall_us_per_step": round(stall_us / steps, 1),
            "gain_us_per_step": round((used * be["miss_us"] - stall_us) / steps, 1)}


def calibrate(presets, layers: int, steps: int, width: int, seed: int, consts: dict, total: int,
              bucket: float = 0.005, min_count: int = 200) -> dict:
    """Per routing preset: precision by rank and score, the threshold where a copy's chance clears the break-even,
    and the modelled gain at a few thresholds around it. The recommended threshold is the highest that some preset
    finds; a preset none of whose buckets clears (``random``: its gate on the previous layer's state is a guess at
    every score) is then replayed at it too (``at_recommended``), to show what the threshold alone leaves it."""
    be = break_even(consts)
    out = {"break_even": be, "presets": {}}
    for preset in presets:
        profile, trace, pred, scores = twin_scored(preset, layers, steps, width, seed)
        table = precision_table(trace[:, 1:], pred, scores, bucket, min_count)
        found = threshold_for(table["by_score"], be["chance"])
        grid = sorted({round(found + d, 6) for d in (-0.04, -0.02, 0.0, 0.02, 0.04)}) if found is not None else []
        gains = [modelled_gain(profile, trace, pred, scores, m, consts, total, Policy()) for m in [None, *grid]]
        out["presets"][preset] = {**table, "threshold": found, "gains": gains}
    found = [v["threshold"] for v in out["presets"].values() if v["threshold"] is not None]
    out["recommended_min_score"] = max(found) if found else None
    for preset, v in out["presets"].items():
        if v["threshold"] is None and found:
            profile, trace, pred, scores = twin_scored(preset, layers, steps, width, seed)
            v["at_recommended"] = modelled_gain(profile, trace, pred, scores, max(found), consts, total, Policy())
    return out


def calibration_table(result: dict) -> str:
    be = result["break_even"]
    lines = [f"copy {be['copy_us']} us, window {be['window_us']:g} us, {be['copies']} copies start in it, the last "
             f"overruns by {be['overrun_us']} us against a miss's {be['miss_us']} us: break-even chance {be['chance']}"]
    for preset, v in result["presets"].items():
        lines.append(f"\n{preset}: precision by rank " + " ".join(f"{p:.2f}" for p in v["by_rank"]))
        lines.append("  score from  entries  precision")
        lines += [f"  {r['score_from']:>10.3f} {r['entries']:>8} {r['precision']:>10.3f}" for r in v["by_score"]]
        lines.append(f"  threshold: {v['threshold']}")
        lines.append("  min_score  copies/step  precision  saved us  stall us  gain us")
        lines += [f"  {str(g['min_score']):>9} {g['copies_per_step']:>12} {str(g['precision']):>10} "
                  f"{g['saved_us_per_step']:>9} {g['stall_us_per_step']:>9} {g['gain_us_per_step']:>8}" for g in v["gains"]]
        if "at_recommended" in v:
            g = v["at_recommended"]
            lines.append(f"  at the recommended {g['min_score']}: {g['copies_per_step']} copies a step, precision "
                         f"{g['precision']}, gain {g['gain_us_per_step']} us a step")
    lines.append(f"\nrecommended GLM53_PREFETCH_MIN_SCORE: {result['recommended_min_score']}")
    return "\n".join(lines)


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
    ap.add_argument("--calibrate", metavar="PRESETS", help="instead of the sweep: the threshold on the predicted score "
                    "(GLM53_PREFETCH_MIN_SCORE) from the routing twins of these presets (e.g. trained,random), with "
                    "--window-ms defaulting to the measured gap between two MoE layers")
    ap.add_argument("--copy-gbs", type=float, default=MEASURED_COPY_GBS, help="prefetch's copy rate, GB/s (H200 host)")
    ap.add_argument("--width", type=int, default=16, help="--calibrate: predicted experts per token scored")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the result as JSON")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)[: args.layers]
    if args.calibrate:
        return calibrate_main(args, profile)
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


def calibrate_main(args, profile: np.ndarray) -> int:
    consts = {"link_gbs": args.link_gbs, "copy_gbs": args.copy_gbs, "expert_bytes": round(args.expert_mb * 1e6),
              "window_ms": args.window_ms if args.window_ms is not None else MEASURED_GAP_MS}
    total = round(args.share * profile.size)
    result = calibrate(args.calibrate.split(","), args.layers, args.steps, args.width, args.seed, consts, total)
    result["model"] = {**consts, "layers": args.layers, "steps": args.steps, "width": args.width, "seed": args.seed,
                       "total_slots": total}
    result["caveat"] = ("the twins' routing state, not the real network's: on the engine the next-layer recall was "
                        "lower (bench.routing_stats --engine), so its precision at a score may be too")
    print(calibration_table(result))
    if args.out:
        emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
