"""``glm53 triton-pin``: record the Triton autotune picks that serving a model makes, and show a pick file.

Recording loads the model with stock exllamav3 the way the exl3 backend does (load, then ``warmup``, which already
runs prefill chunks and batched decode steps), then runs, for each prompt length, a cache-less teacher-forced
forward (the backend's scoring path) and a prefill plus two decode steps through exllamav3's generator (the
serving path, with its chunking and recurrent state), and finally one batch of concurrent jobs. Every autotune
key met on the way is in the written file. The KDA kernels' keys depend on the model's head counts and dims, on
whether a recurrent state goes in or comes out, and (``l2norm_fwd_kernel``'s ``NB``) on the tokens per
2048-token scan range times the heads: the default lengths meet every key of GLM-5.3's shapes at chunk sizes up to
8192 (exllamav3's default scan range, ``EXL3_GDN_SUB_CHUNK`` 2048).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

from .. import config
from ..engine.exl3 import triton_pin_file

# decode tokens generated after each recorded prefill (decode runs no autotuned kernel in exllamav3 1.6.5, but the
# first decode step after a prefill is where a change would show)
DECODE_TOKENS = 2
BATCH_PROMPT_TOKENS = 300


def _setting_default(name: str):
    return next(config.mode_default(f, "exact") for f in config.setting_fields() if f.name == name)


def default_lengths(chunk_size: int) -> list[int]:
    """Prompt lengths that meet every key: below, at and past one 2048-token scan range and one prefill chunk."""
    return sorted({64, 256, 1024, 1536, 2048, 3000, 4096, chunk_size, chunk_size + 1000})


def _lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts >= 1, got {text!r}")
    return values


def add_parser(sub) -> None:
    """The ``triton-pin`` subcommand and its ``record`` and ``show`` commands."""
    tp = sub.add_parser("triton-pin", help="record or show pinned Triton autotune picks (GLM53_TRITON_PIN)",
                        description="Prefill numerics of exllamav3's KDA kernels depend on which Triton autotune config "
                                    "wins; a pick file fixes the winners so every process computes the same logits.")
    cmds = tp.add_subparsers(dest="pin_command", required=True)
    rec = cmds.add_parser("record", help="run a model's prefills on this GPU and write the picks they made",
                          description="Load the model with stock exllamav3 as the server does, run prefills of several "
                                      "lengths and a batch of decodes, and write every autotune pick made. Needs CUDA and "
                                      "exllamav3. The file fits GPUs of this one's compute capability.")
    rec.add_argument("-m", "--model", required=True, type=Path, help="the EXL3 checkpoint directory")
    rec.add_argument("--out", required=True, type=Path, help="the pick file to write")
    rec.add_argument("--lengths", type=_lengths, help="prompt lengths in tokens, comma-separated "
                                                      "(default: 64,256,1024,1536,2048,3000,4096, the chunk size and 1000 past it)")
    rec.add_argument("--chunk-size", type=int, default=_setting_default("chunk_size"), help="prefill chunk in tokens, as GLM53_CHUNK_SIZE (default %(default)s)")
    rec.add_argument("--cache-size", type=int, default=_setting_default("cache_size"), help="KV cache tokens, as GLM53_CACHE_SIZE (default %(default)s)")
    rec.add_argument("--ambs", type=int, default=_setting_default("ambs"), help="recurrent-state slots, as GLM53_AMBS (default %(default)s)")
    rec.add_argument("--max-batch-size", type=int, default=_setting_default("max_batch_size"), help="generator batch, as GLM53_MAX_BATCH_SIZE (default %(default)s)")
    rec.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    rec.add_argument("--merge", action="store_true", help="start from the picks already in --out (they are used, not re-tuned) "
                                                          "and keep them; add what this run meets beyond them")
    show = cmds.add_parser("show", help="print a pick file's GPU, versions and picks")
    show.add_argument("file", type=Path)


def main(ns: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.pin_command == "show":
        return _show(ns.file)
    lengths = ns.lengths or default_lengths(ns.chunk_size)
    try:
        doc = record(ns.model, lengths, chunk_size=ns.chunk_size, cache_size=ns.cache_size, ambs=ns.ambs,
                     max_batch_size=ns.max_batch_size, merge_from=ns.out if ns.merge and ns.out.exists() else None,
                     seed=ns.seed, log=lambda line: print(line, flush=True))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"glm53: {exc}", file=sys.stderr)
        return 1
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(triton_pin_file.dumps(doc))
    picks = sum(len(v) for v in doc["kernels"].values())
    print(f"wrote {ns.out}: {picks} picks for {len(doc['kernels'])} kernels ({doc['gpu']['name']}, "
          f"{triton_pin_file.sm(doc['gpu']['capability'])})")
    return 0


def _show(path: Path) -> int:
    try:
        pins = triton_pin_file.load(path)
    except triton_pin_file.PinFileError as exc:
        print(f"glm53: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: {pins.picks} picks for {len(pins.kernels)} kernels, recorded on {pins.gpu_name} "
          f"({triton_pin_file.sm(pins.capability)}) with triton {pins.triton}, exllamav3 {pins.exllamav3}"
          f"{'; strict' if pins.strict else ''}")
    for kernel, picks in pins.kernels.items():
        print(f"  {kernel}")
        for text, pick in picks.items():
            print(f"    {text} -> {triton_pin_file.show_config(pick.config)}")
    return 0


def load_stock(model_dir: Path, *, cache_size: int, chunk_size: int, ambs: int, max_batch_size: int) -> SimpleNamespace:
    """The model, cache and generator of stock exllamav3, with the sizes and calls of the exl3 backend."""
    from ..engine.exl3.stock import load_stock as load

    stock = load(model_dir, cache_tokens=cache_size, max_batch_size=ambs, chunk_size=chunk_size)
    return SimpleNamespace(model=stock.model, generator=stock.generator(max_batch_size=max_batch_size), vocab_size=stock.vocab_size)


def forward_nc(model, ids: Sequence[int]):
    """A cache-less teacher-forced forward, as the backend's ``score`` runs it: logits [1, len(ids), vocab]."""
    import torch

    with torch.inference_mode():
        return model.forward(torch.tensor([list(ids)], dtype=torch.long), {"attn_mode": "flash_attn_nc"})


def generate(generator, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Prefill each prompt and decode ``max_new_tokens`` greedily, all jobs at once, through the generator."""
    from ..engine.exl3.stock import greedy_job

    for p in prompts:
        generator.enqueue(greedy_job(p, max_new_tokens))
    # a bound, so that a stuck generator fails the recording instead of hanging it
    for _ in range(sum(len(p) for p in prompts) + 64 * (max_new_tokens + 1) * len(prompts)):
        if not generator.num_remaining_jobs():
            return
        generator.iterate()
    raise RuntimeError(f"the generator did not finish {len(prompts)} job(s) of {max_new_tokens} tokens")


def record(model_dir: Path, lengths: Sequence[int], *, chunk_size: int, cache_size: int, ambs: int, max_batch_size: int,
           merge_from: Path | None = None, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """Run the recording workload (module docstring) on the current GPU and return the pick file's JSON.

    :raise ValueError: a length that does not fit the cache, or a pick a file cannot hold.
    :raise RuntimeError: no CUDA GPU. :raise PinFileError: ``merge_from`` is malformed or from another GPU.
    """
    too_long = [n for n in lengths if n + DECODE_TOKENS > cache_size]
    if too_long:
        raise ValueError(f"prompt length {too_long[0]} does not fit the cache of {cache_size} tokens (--cache-size)")
    # imported here, not with the module: `glm53 --help` needs neither torch nor what triton_pin imports
    import torch

    from ..engine.exl3 import triton_pin

    if not torch.cuda.is_available():
        raise RuntimeError("recording Triton picks needs a CUDA GPU")
    base = triton_pin_file.load(merge_from) if merge_from else None
    triton_pin.install(merge_from)
    try:
        t0 = time.monotonic()
        stock = load_stock(model_dir, cache_size=cache_size, chunk_size=chunk_size, ambs=ambs, max_batch_size=max_batch_size)
        log(f"loaded and warmed up {model_dir} in {time.monotonic() - t0:.1f} s")
        rng = random.Random(seed)

        def prompt(n: int) -> list[int]:
            return [rng.randrange(stock.vocab_size) for _ in range(n)]

        for n in lengths:
            t1 = time.monotonic()
            if n <= chunk_size:
                forward_nc(stock.model, prompt(n))
            generate(stock.generator, [prompt(n)], DECODE_TOKENS)
            log(f"  {n} tokens: {time.monotonic() - t1:.1f} s")
        batch = max(1, min(ambs, max_batch_size))
        generate(stock.generator, [prompt(min(BATCH_PROMPT_TOKENS, cache_size // batch - DECODE_TOKENS)) for _ in range(batch)], DECODE_TOKENS)
        kernels = triton_pin.collect()
        stock.generator.close()
        stock.model.unload()
    finally:
        triton_pin.uninstall()
    if base is not None:
        kernels = triton_pin_file.merge(base, kernels)
    device = torch.cuda.current_device()
    recorded = {"model": Path(model_dir).name, "lengths": list(lengths), "chunk_size": chunk_size, "cache_size": cache_size,
                "ambs": ambs, "batch": batch, "date": time.strftime("%Y-%m-%d", time.gmtime())}
    return triton_pin_file.document(kernels, gpu_name=torch.cuda.get_device_name(device),
                                    capability=tuple(torch.cuda.get_device_capability(device)),
                                    versions=triton_pin.runtime_versions(), recorded=recorded)
