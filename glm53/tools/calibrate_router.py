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

import math
import time
from pathlib import Path

import numpy as np

from ..engine.exl3 import patches
from ..engine.exl3.load import load
from ..engine.exl3.stock import sampled_job
from ..models.checkpoint import read_config
from ..progress import Progress
from .synth import router
from .synth.writer import DEFAULT_PROFILE, write_router_biases

DECODE_ROWS = 8  # routing calls of at most this many rows are decode steps; prefill chunks are larger
STOP_FRACTION = 0.6


def calibrate(
    ckpt_dir: Path,
    profile_path: Path | None = None,
    rounds: int = 10,
    streams: int = 8,
    prompt_tokens: int = 64,
    decode_tokens: int = 512,
    step: float = 0.02,
    tolerance: float = 0.05,
    seed: int = 0,
    log=print,
    progress: Progress | None = None,
) -> dict:
    """Measure, adjust, repeat; write the biases; verify on a fresh load; return the report.

    Rounds stop once every layer is within ``STOP_FRACTION * tolerance`` (room for measurement noise). The
    verdict comes from the verification: the checkpoint reloaded from disk, a new workload (another seed), and
    at least as many picks per layer as the profile counted, because a top-32 share measured on fewer picks
    reads high (sampling noise lifts the largest counts). ``progress`` gets the model loads and the rounds.
    """
    progress = progress or Progress()
    ckpt_dir = Path(ckpt_dir)
    meta = read_config(ckpt_dir)["glm53_synth"]
    profile = router.load_profile(profile_path or DEFAULT_PROFILE)
    real_of = {int(k): v for k, v in meta["routing_profile"]["layer_map"].items()}
    rng = np.random.default_rng(seed)
    history = []
    with _Session(ckpt_dir, streams, progress) as run:
        targets = {li: router.target_shares(profile, real_of[li], mlp.num_experts) for li, mlp in run.layers.items()}
        biases = {li: run.bias(li) for li in run.layers}
        progress.phase("calibrating", total=rounds + 1, unit="rounds")
        for r in range(rounds + 1):
            counts, seconds = run.measure(rng, prompt_tokens, decode_tokens)
            progress.advance(1)
            row = _round_report(r, counts, targets, real_of, seconds)
            history.append(row)
            log(f"round {r}: max |top-32 share error| {row['max_top32_error']:.3f} (worst layer {row['worst_layer']}), {seconds:.1f} s")
            if row["max_top32_error"] <= STOP_FRACTION * tolerance or r == rounds:
                break
            for li in run.layers:
                biases[li] = router.calibrate_bias(biases[li], counts[li], targets[li], step)
                run.set_bias(li, biases[li])
    write_router_biases(ckpt_dir, biases)
    top_k = read_config(ckpt_dir)["text_config"]["num_experts_per_tok"]
    per_stream = math.ceil(max(router.profile_total(profile, real) for real in real_of.values()) / (top_k * streams))
    with _Session(ckpt_dir, streams, progress) as run:
        progress.phase("verifying")
        counts, seconds = run.measure(np.random.default_rng(seed + 1), prompt_tokens, per_stream)
        progress.finish()
    verification = _round_report(len(history), counts, targets, real_of, seconds)
    log(f"verification (reloaded, {per_stream * streams} decode tokens): max |top-32 share error| {verification['max_top32_error']:.3f}")
    return {
        "checkpoint": str(ckpt_dir),
        "tolerance": tolerance,
        "passed": verification["max_top32_error"] <= tolerance,
        "workload": {"streams": streams, "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "step": step, "seed": seed},
        "rounds": history,
        "verification": verification,
    }


class _Session:
    """The checkpoint loaded in stock exllamav3 with a routing counter on its decode steps."""

    def __init__(self, ckpt_dir: Path, streams: int, progress: Progress):
        import torch

        self._torch = torch
        self.streams = streams
        patches.check_version()  # the counter and the bias writes are patch points
        self.stock = load(ckpt_dir, cache_tokens=streams * 2048, cache_batch=[streams], warmup=False, progress=progress)
        progress.finish()
        self.vocab, self.model = self.stock.vocab_size, self.stock.model
        patches.check_internals(self.model)
        self.generator = self.stock.generator(max_batch_size=streams)
        self.counter = patches.RoutingCounter(self.model, max_rows=DECODE_ROWS)
        self.counter.install()
        self.layers = dict(self.counter.layers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.counter.uninstall()
        self.generator.close()
        self.stock.close()

    def bias(self, layer: int) -> np.ndarray:
        return self.layers[layer].routing_cfg.e_score_correction_bias.float().cpu().numpy()

    def set_bias(self, layer: int, bias: np.ndarray) -> None:
        mlp = self.layers[layer]
        patches.set_router_bias(mlp, self._torch.from_numpy(bias).to(mlp.routing_cfg.e_score_correction_bias.device))

    def measure(self, rng, prompt_tokens: int, decode_tokens: int) -> tuple[dict[int, list[int]], float]:
        """Picks per expert over one decode workload, and its duration."""
        self.counter.reset()
        t0 = time.monotonic()
        for _ in range(self.streams):
            prompt = rng.integers(1000, min(self.vocab, 150000), size=prompt_tokens).tolist()
            self.generator.enqueue(sampled_job(prompt, decode_tokens, temperature=1.0, seed=int(rng.integers(2**31))))
        while self.generator.num_remaining_jobs():
            self.generator.iterate()
        return self.counter.snapshot(), time.monotonic() - t0


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
