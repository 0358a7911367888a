"""Paired decode check: how far a path under test (B) is from the exact path (A), on the decode path, in one process.

Both paths run over the same loaded model, each with its own cache, and see the same tokens: A decodes greedily,
and at every step A's and B's full-vocabulary next-token distributions are taken on the same prefix. B is always
fed A's token, so a position where B's greedy choice differs is counted and the run continues on A's sequence
(the original's "restart at the first divergence", without a re-prefill). Per position: KL(A || B) over the whole
vocabulary in fp64, top-1 agreement, and where they disagree, A's margin between its first and second choice.

    python3 -m bench.decode_kl -m CKPT --a stock --b perturbed:0.001 --tokens 256 --out kl.json

Paths (``PATHS``, by name, ``name:ARG`` passes ARG):

- ``stock``: plain exllamav3 forwards;
- ``perturbed:REL``: stock, with a relative Gaussian perturbation of size REL (per row, relative to the row's RMS)
  added to every routed MoE layer's output. ``--a stock --b perturbed:1e-3`` measures the noise floor: the KL two
  runs of an exact path show when they differ only by an error of the size of exllamav3's own kernel error.
  ``--a stock --b stock`` is the control (KL exactly 0).

The project's engine (``ENGINE_PATHS``; the checkpoint is then loaded once by ``Exl3Backend`` in fast mode with its
CPU tier, options from ``--engine-args``, and both paths run on that one model, each in a cache of its own):

- ``exact``: the offloaded model with the CPU tier paused (every expert on the GPU: exact mode's numerics);
- ``fast``: the same model with the CPU tier computing the cold misses.

``--a exact --b fast`` is fast mode's paired check; set it against ``--a stock --b perturbed:REL`` (the floor).

Per routed MoE layer, at the same positions: the relative error ``|y_B - y_A| / |y_A|`` of the layer's output
row (what the next layer reads). Both paths see the same tokens, but each layer's input carries the differences of
the layers before it, so deep layers show the propagated error as well as their own; the floor pair measures the
same thing, so the two are comparable layer by layer.

Output JSON: ``{positions, kl_mean, kl_p99, kl_max, top1_agree, first_divergence[], disagreements,
layer_rel_err{mean[], p99[], max[]}, cpu_tier (the engine's CPU-tier device counters: jobs published, done, computed
by the GPU fallback), per_prompt[{i, prompt_len, positions, kl_mean, kl_p99, kl_max, top1_agree,
first_divergence, disagreements, margins[]}], a, b, checkpoint, tokens, seconds, command}``.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from bench.client import percentile
from bench.output import emit_json

PAGE = 256  # exllamav3's cache page


class DecodePath(Protocol):
    """One way of computing the model's next-token logits, with its own sequence state."""

    def reset(self) -> None:
        """Forget the sequence: the next ``logits`` call starts at position 0."""

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids`` to the sequence and return the [V] logits after the last of them."""


# ---- bookkeeping (no GPU, no exllamav3) ----

def kl_full(logits_a: torch.Tensor, logits_b: torch.Tensor) -> float:
    """KL(A || B) of the softmax distributions of two [V] logit vectors, in fp64."""
    la = torch.log_softmax(logits_a.double(), dim=-1)
    lb = torch.log_softmax(logits_b.double(), dim=-1)
    return max(float((la.exp() * (la - lb)).sum()), 0.0)  # rounding leaves -1e-17 where they agree


def margin(logits: torch.Tensor) -> float:
    """Log-probability gap (nats) between the first and second choice."""
    top = torch.log_softmax(logits.double(), dim=-1).topk(2).values
    return float(top[0] - top[1])


def relative_errors(rows_a: Sequence[torch.Tensor], rows_b: Sequence[torch.Tensor]) -> list[float]:
    """|b - a| / |a| per layer (0 where both are zero)."""
    if len(rows_a) != len(rows_b):
        raise ValueError(f"{len(rows_a)} layer outputs from A but {len(rows_b)} from B")
    out = []
    for ya, yb in zip(rows_a, rows_b):
        ya, yb = ya.double(), yb.double()
        norm, diff = float(ya.norm()), float((yb - ya).norm())
        out.append(diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf")))
    return out


@dataclass
class PromptRecord:
    prompt_len: int
    kls: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # A's margin at each disagreement
    layer_errs: list[list[float]] = field(default_factory=list)  # per position: relative error per MoE layer

    @property
    def first_divergence(self) -> int | None:
        return next((i for i, a in enumerate(self.agree) if not a), None)

    def summary(self, i: int) -> dict:
        n = len(self.kls)
        return {
            "i": i, "prompt_len": self.prompt_len, "positions": n,
            "kl_mean": sum(self.kls) / n, "kl_p99": percentile(self.kls, 99), "kl_max": max(self.kls),
            "top1_agree": sum(self.agree) / n, "first_divergence": self.first_divergence,
            "disagreements": n - sum(self.agree), "margins": [round(m, 4) for m in self.margins],
        }


def paired_decode(a: DecodePath, b: DecodePath, prompt: Sequence[int], tokens: int, tap: LayerTap | None = None) -> PromptRecord:
    """Greedy-decode ``tokens`` tokens with A; at every step compare B on the same prefix (B is fed A's tokens).
    With ``tap`` (over the model both paths run), the MoE layers' outputs of the two are compared at every step too.
    Both paths are reset before and after (a path's sequence holds a recurrent-state slot of its cache)."""
    a.reset()
    b.reset()
    record = PromptRecord(len(prompt))

    def both(ids):
        la = a.logits(ids)
        rows_a = tap.take() if tap else None
        lb = b.logits(ids)
        if tap:
            record.layer_errs.append(relative_errors(rows_a, tap.take()))
        return la, lb

    try:
        la, lb = both(prompt)
        for step in range(tokens):
            ta, tb = int(la.argmax()), int(lb.argmax())
            record.kls.append(kl_full(la, lb))
            record.agree.append(ta == tb)
            if ta != tb:
                record.margins.append(margin(la))
            if step + 1 < tokens:
                la, lb = both([ta])
    finally:
        a.reset()
        b.reset()
    return record


def layer_summary(records: list[PromptRecord]) -> dict | None:
    """Mean, p99 and max over all positions of each MoE layer's relative error; None without a tap."""
    rows = [e for r in records for e in r.layer_errs]
    if not rows:
        return None
    layers = list(zip(*rows))
    return {"mean": [sum(v) / len(v) for v in layers], "p99": [percentile(list(v), 99) for v in layers],
            "max": [max(v) for v in layers]}


def summarise(records: list[PromptRecord]) -> dict:
    kls = [k for r in records for k in r.kls]
    agree = [x for r in records for x in r.agree]
    return {
        "positions": len(kls),
        "kl_mean": sum(kls) / len(kls),
        "kl_p99": percentile(kls, 99),
        "kl_max": max(kls),
        "top1_agree": sum(agree) / len(agree),
        "first_divergence": [r.first_divergence for r in records],
        "disagreements": len(agree) - sum(agree),
        "layer_rel_err": layer_summary(records),
        "per_prompt": [r.summary(i) for i, r in enumerate(records)],
    }


# ---- paths over a loaded exllamav3 model ----

def pages_for(tokens: int) -> int:
    """A cache of whole pages holding ``tokens``."""
    return -(-tokens // PAGE) * PAGE


def synthetic_prompt(vocab_size: int, n: int) -> list[int]:
    """``n`` fixed ordinary token ids (the profiling tools' prompt: the same in every run)."""
    return [(17 * i + 3) % min(vocab_size, 1000) + 10 for i in range(n)]


def one_engine_args(ap: argparse.ArgumentParser, engine_args: str, engine_help: str) -> None:
    """The arguments of the benches that decode one sequence on engines of their own (bench.prefetch_decode,
    bench.fast_ablation): the checkpoint, the decode and prompt lengths, more settings, the output file."""
    ap.add_argument("-m", "--model", required=True, type=Path, help="the EXL3 checkpoint")
    ap.add_argument("--tokens", type=int, default=128, help="decode steps per run (default 128)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length before decode (default 64)")
    ap.add_argument("--engine-args", default=engine_args, help=engine_help)
    ap.add_argument("--out", type=Path, help="write the result JSON here (default: print it)")


def check_one_engine_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.tokens < 2 or args.prompt_tokens < 1:
        ap.error("--tokens takes at least 2 and --prompt-tokens a positive number")
    return args


class ModelPath:
    """exllamav3 forwards of one sequence in its own cache (exllamav3's rectangular-batch mode: ``batch_shape``
    and ``past_len``, as its ``Model.warmup`` drives the model), one token per step after the prompt: the decode
    path. ``mode``, when given, is a context manager factory entered around every forward."""

    def __init__(self, model, cache, vocab_size: int, mode: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.model, self.cache, self.vocab_size = model, cache, vocab_size
        self.mode = mode or contextlib.nullcontext
        self.capacity = cache.max_num_tokens // PAGE * PAGE
        self.pos = 0
        self.states = None

    def reset(self) -> None:
        for state in self.states or ():
            self.cache.release_state(state)
        self.pos, self.states = 0, None

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        if self.pos + len(token_ids) > self.capacity:
            raise ValueError(f"sequence of {self.pos + len(token_ids)} tokens exceeds the cache ({self.capacity})")
        params = {"attn_mode": "flash_attn", "cache": self.cache, "batch_shape": (1, self.capacity),
                  "past_len": self.pos, "last_tokens_only": 1}
        if self.states is not None:
            params["recurrent_states"] = self.states
        with torch.inference_mode(), self.mode():
            out = self.model.forward(torch.tensor([list(token_ids)], dtype=torch.long), params)
        self.states = params.get("recurrent_states")  # created by the first forward of a recurrent model
        self.pos += len(token_ids)
        return out[0, -1, : self.vocab_size].float()


class Perturbation:
    """Adds ``rel * rms(row) * N(0, 1)`` to every row of each routed MoE layer's output while enabled
    (deterministic: the generator is reseeded on ``reset``). Installed by wrapping each layer's ``forward``."""

    def __init__(self, model, rel: float, seed: int = 0):
        from glm53.engine.exl3.patches import wrap_output

        self.rel, self.seed, self.enabled = rel, seed, False
        self.layers = routed_moe_layers(model)
        self.generator = torch.Generator(device=self.layers[0].device)
        for m in self.layers:
            wrap_output(m, lambda y: self._perturb(y) if self.enabled else y)

    def _perturb(self, y: torch.Tensor) -> torch.Tensor:
        flat = y.reshape(-1, y.shape[-1]).float()  # [rows, hidden]
        rms = flat.pow(2).mean(dim=-1, keepdim=True).sqrt()  # [rows, 1]
        noise = torch.randn(flat.shape, generator=self.generator, device=flat.device, dtype=torch.float32)
        return (flat + self.rel * rms * noise).to(y.dtype).reshape(y.shape)

    def reset(self) -> None:
        self.generator.manual_seed(self.seed)

    @contextlib.contextmanager
    def active(self):
        self.enabled = True
        try:
            yield
        finally:
            self.enabled = False


class LayerTap:
    """Keeps each routed MoE layer's output row for the last position of the latest forward (fp32, on the device),
    whichever path ran it. Installed over the paths' own wrappers, so it sees what the next layer reads."""

    def __init__(self, model):
        from glm53.engine.exl3.patches import wrap_output

        self.layers = routed_moe_layers(model)
        self.rows: list[torch.Tensor | None] = [None] * len(self.layers)
        for i, m in enumerate(self.layers):
            wrap_output(m, lambda y, _i=i: self._keep(_i, y))

    def _keep(self, i: int, y: torch.Tensor) -> torch.Tensor:
        self.rows[i] = y.reshape(-1, y.shape[-1])[-1].float().clone()
        return y

    def take(self) -> list[torch.Tensor]:
        """The rows of the latest forward, then forgets them."""
        rows, self.rows = self.rows, [None] * len(self.layers)
        if any(r is None for r in rows):
            raise RuntimeError("a routed MoE layer did not run in the latest forward")
        return rows


def routed_moe_layers(model) -> list:
    """The model's routed MoE layers (exllamav3 BlockSparseMLP modules), in layer order."""
    from glm53.engine.exl3.patches import moe_layers

    layers = [m for _, m in moe_layers(model)]
    if not layers:
        raise ValueError("the model has no routed MoE layers")
    return layers


class PerturbedPath(ModelPath):
    def __init__(self, model, cache, vocab_size: int, rel: float):
        self.perturbation = Perturbation(model, rel)
        super().__init__(model, cache, vocab_size, mode=self.perturbation.active)

    def reset(self) -> None:
        super().reset()
        self.perturbation.reset()


def _stock(model, cache, vocab_size: int, arg: str | None) -> DecodePath:
    return ModelPath(model, cache, vocab_size)


def _perturbed(model, cache, vocab_size: int, arg: str | None) -> DecodePath:
    if arg is None:
        raise ValueError("perturbed needs a relative size, e.g. perturbed:0.001")
    return PerturbedPath(model, cache, vocab_size, float(arg))


def _engine_exact(backend, cache, vocab_size: int, arg: str | None) -> DecodePath:
    fast = backend.offload.tier
    return ModelPath(backend.model, cache, vocab_size, mode=fast.paused if fast is not None else None)


def _engine_fast(backend, cache, vocab_size: int, arg: str | None) -> DecodePath:
    if backend.offload.tier is None:
        raise ValueError("the fast path needs the engine's CPU tier (GLM53_CT_ENABLE), which is off")
    return ModelPath(backend.model, cache, vocab_size)


# name -> factory(model, cache, vocab_size, arg) -> DecodePath, over a stock exllamav3 load; a name that is in
# neither table is refused with the list of names
PATHS: dict[str, Callable[..., DecodePath]] = {"stock": _stock, "perturbed": _perturbed}
# name -> factory(Exl3Backend, cache, vocab_size, arg) -> DecodePath, over the engine's load (see the docstring)
ENGINE_PATHS: dict[str, Callable[..., DecodePath]] = {"exact": _engine_exact, "fast": _engine_fast}


def make_path(spec: str, model, cache, vocab_size: int) -> DecodePath:
    """:raise ValueError: an unknown path name or a bad argument."""
    name, _, arg = spec.partition(":")
    if name not in PATHS:
        raise ValueError(f"unknown path {name!r}; known: {', '.join(sorted(PATHS | ENGINE_PATHS))}")
    return PATHS[name](model, cache, vocab_size, arg or None)


def make_engine_path(spec: str, backend, cache) -> DecodePath:
    """:raise ValueError: not an engine path, or a bad argument."""
    name, _, arg = spec.partition(":")
    if name not in ENGINE_PATHS:
        raise ValueError(f"{name!r} is not an engine path ({', '.join(sorted(ENGINE_PATHS))}); stock paths need a stock load")
    return ENGINE_PATHS[name](backend, cache, backend.info.vocab_size, arg or None)


def engine_argv(model: Path, cache_tokens: int, engine_args: str) -> list[str]:
    """The engine's settings for the paired check: fast mode with its CPU tier, one sequence, then ``engine_args``."""
    # a prefill chunk no longer than the cache: exllamav3's load runs a chunk-sized forward over it
    return ["--engine", "exl3", "--mode", "fast", "--ct-enable", "1", "-m", str(model), "-cs", str(cache_tokens),
            "-chunk_size", str(min(2048, cache_tokens)), "--max-batch-size", "1", "-ambs", "1", *shlex.split(engine_args)]


# ---- command line ----

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m bench.decode_kl", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, type=Path, help="the EXL3 checkpoint")
    ap.add_argument("--a", default="stock", help="the exact path (default stock)")
    ap.add_argument("--b", required=True, help="the path under test, e.g. perturbed:0.001")
    ap.add_argument("--prompts", type=Path, help="prompts (JSON list or one per line; default: glm53 panel's built-in list)")
    ap.add_argument("--max-prompts", type=int, default=6, help="use the first N prompts (default 6, as the original)")
    ap.add_argument("--tokens", type=int, default=256, help="decode steps per prompt (default 256)")
    ap.add_argument("--out", type=Path, help="write the result JSON here (default: print it)")
    ap.add_argument("--engine-args", default="--ec-cache-experts 11%",
                    help="glm53 settings for the engine paths (default: --ec-cache-experts 11%%)")
    ap.add_argument("--split", choices=("measured", "all"), default="measured",
                    help="engine paths: the CPU tier takes the misses its measured cost model gives it, or all of them "
                         "(the strongest check of its numerics; default measured)")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.max_prompts < 1:
        ap.error("--tokens and --max-prompts take positive numbers")
    kinds = {spec.partition(":")[0] in ENGINE_PATHS for spec in (args.a, args.b)}
    if len(kinds) > 1:
        ap.error("--a and --b must both be stock paths (stock, perturbed) or both engine paths (exact, fast)")
    return args


def run(args: argparse.Namespace) -> dict:
    from glm53.engine.exl3.tokenizer import HFTokenizer
    from glm53.engine.exl3.stock import load_stock
    from glm53.tools.panel import load_prompts, prompt_ids
    from glm53.models.chat_template import ChatTemplate

    started = time.monotonic()
    template = ChatTemplate.from_model_dir(args.model)
    texts = load_prompts(args.prompts)[: args.max_prompts]
    # rendered with the checkpoint's tokenizer before the load: the cache is sized from the longest prompt
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    tok = HFTokenizer(hf, hf.get_vocab_size(with_added_tokens=True))
    prompts = [prompt_ids(template, tok.encode, t) for t in texts]
    cache_tokens = pages_for(max(map(len, prompts)) + args.tokens)
    if args.a.partition(":")[0] in ENGINE_PATHS:
        from glm53 import config
        from glm53.engine.exl3.backend import Exl3Backend

        engine = Exl3Backend(config.load(engine_argv(args.model, cache_tokens, args.engine_args), {}), extra_caches=2)
        if args.split == "all" and engine.offload.tier is not None:
            from glm53.cpu_tier.split import every_miss_to_the_cpu

            engine.offload.tier.use_costs(every_miss_to_the_cpu(engine.offload.tier.costs))
        a, b = (make_engine_path(spec, engine, cache) for spec, cache in zip((args.a, args.b), engine.extra_caches))
        model, close = engine.model, engine.close
    else:
        stock = load_stock(args.model, cache_tokens=cache_tokens, caches=2)
        a = make_path(args.a, stock.model, stock.caches[0], stock.vocab_size)
        b = make_path(args.b, stock.model, stock.caches[1], stock.vocab_size)
        model, close = stock.model, stock.close
    tap = LayerTap(model)  # after the paths: it wraps their wrappers (a perturbation's)
    records = []
    for i, ids in enumerate(prompts):
        records.append(paired_decode(a, b, ids, args.tokens, tap))
        s = records[-1].summary(i)
        print(f"prompt {i}: KL mean {s['kl_mean']:.3g}, p99 {s['kl_p99']:.3g}, top-1 {s['top1_agree']:.4f}, "
              f"first divergence {s['first_divergence']}", file=sys.stderr, flush=True)
    # the CPU tier's device counters of the engine paths: how many of B's jobs arrived, and how many the GPU computed
    cpu_tier = engine.offload.stats().get("cpu_tier", {}).get("device") if args.a.partition(":")[0] in ENGINE_PATHS else None
    close()
    return {**summarise(records), "a": args.a, "b": args.b, "split": args.split if args.a in ENGINE_PATHS else None,
            "cpu_tier": cpu_tier, "checkpoint": str(args.model), "tokens": args.tokens,
            "seconds": round(time.monotonic() - started, 1), "command": shlex.join(["python3", "-m", "bench.decode_kl", *sys.argv[1:]])}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    emit_json(result, args.out)
    print(f"{result['positions']} positions: KL mean {result['kl_mean']:.3g}, p99 {result['kl_p99']:.3g}, "
          f"max {result['kl_max']:.3g}, top-1 {result['top1_agree']:.4f}", file=sys.stderr)
    if result["layer_rel_err"]:
        means = ", ".join(f"{v:.2e}" for v in result["layer_rel_err"]["mean"])
        print(f"MoE layer output relative error, mean per layer: {means}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
