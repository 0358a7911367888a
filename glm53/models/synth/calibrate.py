"""Calibrate a synthetic checkpoint's router biases against routing MEASURED on the GPU.

The writer fits each MoE layer's ``e_score_correction_bias`` under an i.i.d. model of the router logits, which
under-reproduces the skew of deep layers (the hidden states a real run feeds the router are not i.i.d.). Here
the checkpoint runs in stock exllamav3 on a decode workload (random prompts, sampled answers, several streams),
the picks of every expert are counted on the device, and the biases move toward the routing profile's shares
(``router.calibrate_bias``), round after round, until every layer's top-32 share is within the tolerance of
the profile's. The final biases are written into the checkpoint in place; the report holds every round.

Needs CUDA and exllamav3: ``glm53 calibrate-router -m DIR`` (run on the GPU machine after ``glm53 synth``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from . import router
from .writer import DEFAULT_PROFILE, write_router_biases

DECODE_ROWS = 8  # routing calls of at most this many rows are decode steps; prefill chunks are larger


def calibrate(
    ckpt_dir: Path,
    profile_path: Path | None = None,
    rounds: int = 10,
    streams: int = 8,
    prompt_tokens: int = 64,
    decode_tokens: int = 256,
    step: float = 0.02,
    tolerance: float = 0.05,
    seed: int = 0,
    log=print,
) -> dict:
    """Measure, adjust, repeat; write the biases; return the report (per round, per layer)."""
    import torch
    from exllamav3 import Cache, CacheLayer_fp16, ComboSampler, Config, Generator, Job, Model, Tokenizer

    from ...offload.exl3_patch import RoutingCounter, check_internals, set_router_bias

    ckpt_dir = Path(ckpt_dir)
    meta = json.loads((ckpt_dir / "config.json").read_text())["glm53_synth"]
    profile = router.load_profile(profile_path or DEFAULT_PROFILE)
    real_of = {int(k): v for k, v in meta["routing_profile"]["layer_map"].items()}

    cfg = Config.from_directory(str(ckpt_dir))
    model = Model.from_config(cfg)
    cache = Cache(model, max_num_tokens=streams * 1024, layer_type=CacheLayer_fp16, max_batch_size=streams)
    model.load(progressbar=False, max_batch_size=streams)
    check_internals(model)
    generator = Generator(model, cache, Tokenizer.from_config(cfg), max_batch_size=streams)
    counter = RoutingCounter(model, max_rows=DECODE_ROWS)
    counter.install()
    layers = dict(counter.layers)
    targets = {li: router.target_shares(profile, real_of[li], mlp.num_experts) for li, mlp in layers.items()}
    biases = {li: mlp.routing_cfg.e_score_correction_bias.float().cpu().numpy() for li, mlp in layers.items()}
    rng = np.random.default_rng(seed)
    vocab = cfg.vocab_size
    history = []
    for r in range(rounds + 1):
        counter.reset()
        t0 = time.monotonic()
        _decode_workload(generator, Job, ComboSampler, torch, rng, vocab, streams, prompt_tokens, decode_tokens)
        counts = counter.snapshot()
        row = _round_report(r, counts, targets, real_of, time.monotonic() - t0)
        history.append(row)
        log(f"round {r}: max |top-32 share error| {row['max_top32_error']:.3f} (worst layer {row['worst_layer']}), {row['seconds']:.1f} s")
        if row["max_top32_error"] <= tolerance or r == rounds:
            break
        for li, mlp in layers.items():
            biases[li] = router.calibrate_bias(biases[li], counts[li], targets[li], step)
            set_router_bias(mlp, torch.from_numpy(biases[li]).to(mlp.routing_cfg.e_score_correction_bias.device))
    counter.uninstall()
    generator.close()
    model.unload()
    write_router_biases(ckpt_dir, biases)
    final = history[-1]
    return {
        "checkpoint": str(ckpt_dir),
        "tolerance": tolerance,
        "passed": final["max_top32_error"] <= tolerance,
        "workload": {"streams": streams, "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "step": step, "seed": seed},
        "rounds": history,
    }


def _decode_workload(generator, Job, ComboSampler, torch, rng, vocab, streams, prompt_tokens, decode_tokens) -> None:
    """``streams`` jobs of random prompt ids, sampled at temperature 1, decoded together."""
    for _ in range(streams):
        prompt = torch.from_numpy(rng.integers(1000, min(vocab, 150000), size=(1, prompt_tokens))).long()
        seed = int(rng.integers(2**31))
        generator.enqueue(Job(input_ids=prompt, max_new_tokens=decode_tokens, sampler=ComboSampler(temperature=1.0), seed=seed))
    while generator.num_remaining_jobs():
        generator.iterate()


def _round_report(r: int, counts: dict[int, list[int]], targets: dict[int, np.ndarray], real_of: dict[int, int], seconds: float) -> dict:
    layers = {}
    for li, c in counts.items():
        t = targets[li]
        measured = router.top_share(c)
        wanted = router.top_share(t * 1e6)
        share = np.asarray(c, dtype=np.float64) / max(sum(c), 1)
        layers[str(li)] = {
            "real_layer": real_of[li],
            "picks": int(sum(c)),
            "top32_measured": round(measured, 4),
            "top32_profile": round(wanted, 4),
            "top32_error": round(measured - wanted, 4),
            "total_variation": round(0.5 * float(np.abs(share - t).sum()), 4),
        }
    worst = max(layers, key=lambda k: abs(layers[k]["top32_error"]))
    return {
        "round": r,
        "seconds": round(seconds, 2),
        "max_top32_error": abs(layers[worst]["top32_error"]),
        "worst_layer": int(worst),
        "layers": layers,
    }
