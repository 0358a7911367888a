"""Routing traces of a checkpoint and what a cache or a prefetch can get from them: per MoE layer and overall,

- the reuse-distance distribution: for every pick, the decode steps since the layer last picked that expert;
- hit curves at 16-128 slots per layer of LRU, LFU, the project's decayed frequency (``cache_policy.ReferenceCache``
  with ``Policy``'s defaults) and Belady's optimum, each starting from the profile's hottest experts (as the cache
  does, ``bench.cache_policy_sim``'s replays);
- the next layer's gate applied to this layer's router input as a predictor of the next layer's picks: recall
  (true picks found / top-k) and precision (true picks found / guesses) at 8 and 16 guesses;
- popularity against the profile the router was fitted to: total-variation distance of the pick shares and the
  top-32 share, measured and targeted.

Traces come from one of two places. On the CPU (the default): the checkpoint's routing twin
(``glm53.tools.synth.routing.Twin``), the routing state alone at the routing subspace's width with the
checkpoint's gate directions and selection biases, read from ``--ckpt`` or built from the generator's settings as
``glm53 synth`` would build them. On a GPU (``--engine``, GPU only): the real engine decoding greedily, the picks
and predictions taken from its routing hook.

A routing preset is accepted when its overall figures land in its bands (``presets.ROUTING_PRESETS``, stated at
288 experts top-8); ``bands`` in the result says which did.

    python3 -m bench.routing_stats --preset scaled --routing trained [--steps 2000] [--out stats.json]
    python3 -m bench.routing_stats --ckpt CKPT [--engine --tokens 512]   # --engine: on a GPU
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cache_policy_sim import run_belady, run_decayed, run_lfu, run_lru
from bench.output import emit_json
from glm53.offload.cache import Policy
from glm53.tools.synth import presets, router, routing, writer

SLOTS = (16, 32, 64, 128)
POLICIES = ("lru", "lfu", "decayed", "belady")
GUESSES = (8, 16)
REUSE_BINS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a pick's reuse distance d falls in the first bin with d <= bin
RUNS = {"lru": lambda trace, start, profile: run_lru(trace, start),
        "lfu": lambda trace, start, profile: run_lfu(trace, start),
        "decayed": lambda trace, start, profile: run_decayed(trace, start, profile, Policy()),
        "belady": lambda trace, start, profile: run_belady(trace, start)}


def twin_from_settings(preset: str, routing_preset: str, seed: int, moe_layers: int | None,
                       profile: Path = writer.DEFAULT_PROFILE) -> tuple[routing.Twin, np.ndarray]:
    """The twin of the checkpoint ``glm53 synth`` would write with these arguments, and its target shares
    float [layers, experts], without writing it (the biases are fitted as the writer fits them)."""
    shape = presets.resolve(preset, moe_layers)
    dynamics = routing.resolve(routing_preset).dynamics
    targets = writer.router_targets(shape, router.load_profile(profile))
    biases = writer.fit_biases(shape, targets, presets.SCALES, seed, dynamics)
    twin = routing.Twin(seed, shape.moe_layer_indices, [biases[i] for i in shape.moe_layer_indices], shape.top_k,
                        dynamics, presets.SCALES.router_sigma)
    return twin, np.stack([targets[i] for i in shape.moe_layer_indices])


def twin_from_checkpoint(ckpt: Path) -> tuple[routing.Twin, np.ndarray, str]:
    """The twin of a checkpoint written by ``glm53 synth`` (its biases as stored, calibrated or not), the shares of
    the profile it shipped with (``ROUTING_PROFILE_FILE``), and its routing preset's name.

    :raise ValueError: not a synthetic checkpoint.
    """
    from glm53.models.checkpoint import ROUTING_PROFILE_FILE

    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    synth, text = cfg.get("glm53_synth"), cfg["text_config"]
    if synth is None:
        raise ValueError(f"{ckpt} is not a synthetic checkpoint (no glm53_synth in config.json)")
    name, dynamics = routing.from_record(synth)
    biases = writer.read_router_biases(ckpt)
    layers = sorted(biases)
    counts = json.loads((Path(ckpt) / ROUTING_PROFILE_FILE).read_text())
    profile = np.array([counts[router.profile_key(i)] for i in layers], dtype=np.float64)
    twin = routing.Twin(synth["seed"], layers, [biases[i] for i in layers], text["num_experts_per_tok"], dynamics,
                        synth["routing_profile"]["router_sigma"])
    return twin, profile / profile.sum(axis=1, keepdims=True), name


def twin_trace(twin: routing.Twin, steps: int, trace_seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(picks int [steps, layers, top_k], predictions int [steps, layers - 1, max(GUESSES)]: layer l + 1's gate on
    layer l's routing state, best first)."""
    run = twin.run(steps, trace_seed)
    guesses = np.stack([routing.top_picks(run.next_logits[:, i], twin.biases[i + 1], max(GUESSES))
                        for i in range(run.next_logits.shape[1])], axis=1)
    return run.picks, guesses


def reuse_distances(picks: np.ndarray) -> np.ndarray:
    """int64 [steps * top_k]: per pick of one layer (picks int [steps, top_k]), the steps since the layer last
    picked the expert; 0 for its first pick."""
    last: dict[int, int] = {}
    out = np.zeros(picks.size, dtype=np.int64)
    for t, step in enumerate(picks):
        for j, e in enumerate(step):
            e = int(e)
            if e in last:
                out[t * picks.shape[1] + j] = t - last[e]
            last[e] = t
    return out


def reuse_histogram(distances: np.ndarray) -> dict[str, float]:
    """Shares of the picks by reuse distance: ``<=b`` per bin, ``longer``, ``first`` (never picked before)."""
    n = max(distances.size, 1)
    seen = distances[distances > 0]
    out, low = {}, 0
    for b in REUSE_BINS:
        out[f"<={b}"] = round(float(((seen > low) & (seen <= b)).sum()) / n, 4)
        low = b
    out["longer"] = round(float((seen > REUSE_BINS[-1]).sum()) / n, 4)
    out["first"] = round(float((distances == 0).sum()) / n, 4)
    return out


def hit_rate(policy: str, picks: np.ndarray, shares: np.ndarray, slots: int) -> float:
    """One layer's hit rate (picks int [steps, top_k], shares float [experts]) under ``policy`` with ``slots``
    slots, starting from the ``slots`` experts of the largest shares (ties to the lower id)."""
    start = [[int(e) for e in np.lexsort((np.arange(shares.size), -shares))[:slots]]]
    return RUNS[policy](picks[:, None, :], start, shares[None, :]) / picks.size


def guess_scores(truth: np.ndarray, guesses: np.ndarray) -> dict[str, float]:
    """Recall and precision of ``guesses`` int [steps, n] (best first) for ``truth`` int [steps, top_k], at each of
    ``GUESSES`` (the first n guesses)."""
    out = {}
    for n in GUESSES:
        found = (truth[:, :, None] == guesses[:, None, :n]).any(axis=2).sum()
        out[f"recall_{n}"] = round(float(found) / truth.size, 4)
        out[f"precision_{n}"] = round(float(found) / (truth.shape[0] * n), 4)
    return out


def popularity(picks: np.ndarray, shares: np.ndarray) -> dict[str, float]:
    """One layer's pick shares against the target ``shares``: total variation and the top-32 shares."""
    counts = np.bincount(picks.reshape(-1), minlength=shares.size).astype(np.float64)
    return {"tv": round(0.5 * float(np.abs(counts / counts.sum() - shares).sum()), 4),
            "top32": round(router.top_share(counts), 4), "top32_target": round(router.top_share(shares), 4)}


def measure(picks: np.ndarray, guesses: np.ndarray, shares: np.ndarray, slots: Sequence[int] = SLOTS,
            policies: Sequence[str] = POLICIES) -> dict:
    """Every figure per layer and overall (the mean over layers; every layer has as many picks).

    :param picks: int [steps, layers, top_k]; ``guesses``: int [steps, layers - 1, n >= max(GUESSES)] for layers
        1.. (layer l's guesses come from layer l - 1); ``shares``: float [layers, experts] the targets.
    """
    layers = []
    for i in range(picks.shape[1]):
        row = {"reuse": reuse_histogram(reuse_distances(picks[:, i])),
               "hits": {p: {str(s): round(hit_rate(p, picks[:, i], shares[i], s), 4) for s in slots} for p in policies},
               "popularity": popularity(picks[:, i], shares[i])}
        if i > 0:
            row["next_gate"] = guess_scores(picks[:, i], guesses[:, i - 1])
        layers.append(row)

    def mean(get):
        values = [get(row) for row in layers if get(row) is not None]
        return round(float(np.mean(values)), 4)

    overall = {
        "reuse": {k: mean(lambda r, k=k: r["reuse"][k]) for k in layers[0]["reuse"]},
        "hits": {p: {str(s): mean(lambda r, p=p, s=s: r["hits"][p][str(s)]) for s in slots} for p in policies},
        "next_gate": {k: mean(lambda r, k=k: r.get("next_gate", {}).get(k)) for k in guess_scores(picks[:1, 0], guesses[:1, 0])}
                     if picks.shape[1] > 1 else {},
        "popularity_tv": mean(lambda r: r["popularity"]["tv"]),
        "top32_share_error": mean(lambda r: abs(r["popularity"]["top32"] - r["popularity"]["top32_target"])),
    }
    return {"overall": overall, "layers": layers}


def figures(overall: dict) -> dict[str, float]:
    """The overall figures the presets' bands are stated in."""
    out = {"top32_share_error": overall["top32_share_error"]}
    if overall["next_gate"]:
        out["next_gate_recall_8"] = overall["next_gate"]["recall_8"]
    if "lru" in overall["hits"] and "64" in overall["hits"]["lru"]:
        out["lru_hit_64"] = overall["hits"]["lru"]["64"]
    return out


def check_bands(routing_preset: str, overall: dict, experts: int, top_k: int) -> dict:
    """Each band of the preset: the measured figure, the band, whether it lands; ``applies`` False when the routing
    shape is not the one the bands are stated at (then nothing is checked)."""
    bands = routing.resolve(routing_preset).bands
    if (experts, top_k) != (presets.BAND_EXPERTS, presets.BAND_TOP_K):
        return {"applies": False, "checks": {}}
    got = figures(overall)
    checks = {name: {"value": got.get(name), "band": list(band),
                     "ok": got.get(name) is not None and band[0] <= got[name] <= band[1]} for name, band in bands.items()}
    return {"applies": True, "accepted": all(c["ok"] for c in checks.values()), "checks": checks}


def record_engine(ckpt: Path, tokens: int, prompt_tokens: int, engine_args: str = "") -> tuple[np.ndarray, np.ndarray, dict]:
    """GPU only. The real engine's routing over ``tokens`` greedy decode steps after a fixed prompt (exact mode, one
    sequence): (picks int [tokens - 1, layers, top_k], guesses int [tokens - 1, layers - 1, max(GUESSES)], router),
    the guesses scored as the prefetcher scores them (the next layer's router on this layer's router input: sigmoid,
    plus the correction bias, top n); ``router``: each layer's own gate on its router input at each step, ``logits``
    float32 [tokens - 1, layers, experts] before the sigmoid, and ``biases`` float32 [layers, experts] (zeros where
    the router has none), what ``bench.cache_policy_soft --engine-trace`` replays the soft score on. Only one-row
    routing calls (decode steps) are recorded, not the prompt's."""
    import torch

    from bench.decode_kl import ModelPath, pages_for, synthetic_prompt
    from bench.prefetch_decode import decode
    from glm53 import config
    from glm53.engine.exl3 import patches
    from glm53.engine.exl3.backend import Exl3Backend

    cache_tokens = pages_for(prompt_tokens + tokens + 1)
    argv = ["--engine", "exl3", "--mode", "exact", "-m", str(ckpt), "-cs", str(cache_tokens), "-chunk_size",
            str(min(2048, cache_tokens)), "--max-batch-size", "1", "-ambs", "1", *shlex.split(engine_args)]
    engine = Exl3Backend(config.load(argv, {}), extra_caches=1)
    removers = []
    try:
        mlps = [m for _, m in patches.moe_layers(engine.model)]
        top_k = int(mlps[0].num_experts_per_tok)
        gates = patches.routers(patches.MoeLayers(mlps, [], top_k, 0.0))
        picks: list[list] = [[] for _ in mlps]
        guesses: list[list] = [[] for _ in mlps[1:]]
        logits: list[list] = [[] for _ in mlps]

        def hook(row, selected, weights, z, params):
            if selected.shape[0] != 1:
                return
            picks[row].append(selected.reshape(-1).clone())
            own = gates[row][0]
            logits[row].append(torch.matmul(z.view(-1, own.shape[0]).to(own.dtype), own).float().reshape(-1))
            if row + 1 < len(mlps):
                gate, bias = gates[row + 1]
                scores = torch.matmul(z.view(-1, gate.shape[0]).to(gate.dtype), gate).float().sigmoid()
                scores = scores if bias is None else scores + bias.float()
                guesses[row].append(torch.topk(scores.reshape(-1), max(GUESSES), sorted=True).indices)

        for row, mlp in enumerate(mlps):
            removers.append(patches.add_routing_hook(mlp, lambda s, w, z, p, _row=row: hook(_row, s, w, z, p),
                                                     with_inputs=True))
        path = ModelPath(engine.model, engine.extra_caches[0], engine.info.vocab_size)
        decode(path, synthetic_prompt(engine.info.vocab_size, prompt_tokens), tokens)
        steps = min(len(p) for p in picks)
        as_array = lambda rows, dtype=np.int64: torch.stack(rows[:steps]).cpu().numpy().astype(dtype)  # one sync, at the end
        experts = gates[0][0].shape[1]
        router = {"logits": np.stack([as_array(rows, np.float32) for rows in logits], axis=1),
                  "biases": np.stack([np.zeros(experts, np.float32) if bias is None else bias.float().cpu().numpy().reshape(-1)
                                      for _, bias in gates])}
        return (np.stack([as_array(p) for p in picks], axis=1),
                np.stack([as_array(g) for g in guesses], axis=1) if guesses else np.zeros((steps, 0, max(GUESSES)), np.int64),
                router)
    finally:
        for remove in removers:
            remove()
        engine.close()


def table(result: dict) -> str:
    o = result["overall"]
    lines = ["hit rate by slots per layer: " + "  ".join(
        f"{p} " + "/".join(f"{v:.3f}" for v in o["hits"][p].values()) for p in o["hits"]) + f"  (slots {'/'.join(o['hits'][next(iter(o['hits']))])})"]
    if o["next_gate"]:
        lines.append("next-layer gate: " + ", ".join(f"{k} {v:.3f}" for k, v in o["next_gate"].items()))
    lines.append("reuse distance: " + ", ".join(f"{k} {v:.3f}" for k, v in o["reuse"].items()))
    lines.append(f"popularity: TV {o['popularity_tv']:.3f}, |top-32 share error| {o['top32_share_error']:.3f}")
    bands = result["bands"]
    if bands["applies"]:
        lines.append(f"bands of {result['routing']}: " + ("accepted" if bands["accepted"] else "NOT accepted") + "; " + ", ".join(
            f"{k} {c['value']} in {c['band']}: {'ok' if c['ok'] else 'no'}" for k, c in bands["checks"].items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.routing_stats", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, help="a checkpoint (its twin on the CPU; with --engine, the real engine)")
    ap.add_argument("--preset", default="scaled", help="without --ckpt: the checkpoint preset whose twin to build")
    ap.add_argument("--routing", default="trained", choices=tuple(presets.ROUTING_PRESETS), help="without --ckpt")
    ap.add_argument("--moe-layers", type=int, help="without --ckpt: MoE layers (default: the preset's)")
    ap.add_argument("--seed", type=int, default=0, help="without --ckpt: the checkpoint's seed")
    ap.add_argument("--steps", type=int, default=2000, help="decode steps of the twin's trace")
    ap.add_argument("--trace-seed", type=int, default=0)
    ap.add_argument("--slots", default=",".join(map(str, SLOTS)), help="slots per layer of the hit curves")
    ap.add_argument("--engine", action="store_true", help="GPU only: record from the real engine (needs --ckpt)")
    ap.add_argument("--tokens", type=int, default=512, help="with --engine: greedy decode steps")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="with --engine: the fixed prompt's length")
    ap.add_argument("--engine-args", default="", help="with --engine: more engine settings")
    ap.add_argument("--trace-out", type=Path, help="also save the picks (.npy int [steps, layers, top_k], for "
                                                   "bench.cache_policy_sim --trace)")
    ap.add_argument("--logits-out", type=Path, help="with --engine: also save each layer's router logits and biases "
                                                    "(.npz, for bench.cache_policy_soft --engine-trace)")
    ap.add_argument("--out", type=Path, help="write the result JSON here (default: print it)")
    args = ap.parse_args(argv)
    if args.ckpt is not None:
        twin, shares, name = twin_from_checkpoint(args.ckpt)
    elif args.engine:
        ap.error("--engine needs --ckpt")
    else:
        twin, shares = twin_from_settings(args.preset, args.routing, args.seed, args.moe_layers)
        name = args.routing
    if args.logits_out and not args.engine:
        ap.error("--logits-out goes with --engine (a twin's logits: bench.cache_policy_soft draws its own)")
    if args.engine:
        picks, guesses, router = record_engine(args.ckpt, args.tokens, args.prompt_tokens, args.engine_args)
        if args.logits_out:
            np.savez_compressed(args.logits_out, **router)
    else:
        picks, guesses = twin_trace(twin, args.steps, args.trace_seed)
    if args.trace_out:
        np.save(args.trace_out, picks)
    result = {"source": "engine" if args.engine else "twin", "checkpoint": str(args.ckpt) if args.ckpt else None,
              "preset": None if args.ckpt else args.preset, "routing": name, "seed": twin.seed,
              "steps": int(picks.shape[0]), "layers": int(picks.shape[1]), "experts": twin.experts, "top_k": twin.top_k,
              **measure(picks, guesses, shares, [int(s) for s in args.slots.split(",")])}
    result["bands"] = check_bands(name, result["overall"], twin.experts, twin.top_k)
    result["command"] = shlex.join(["python3", "-m", "bench.routing_stats", *(sys.argv[1:] if argv is None else argv)])
    print(table(result), file=sys.stderr)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
