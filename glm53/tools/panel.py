"""``glm53 panel``: a reference panel made by STOCK exllamav3, for ``bench/score_ref_panel.py``.

For each prompt: the user text rendered in the thinking-off chat format (the checkpoint's chat template, as the
server renders it: ``[gMASK]<sop><|user|>…<|assistant|><think></think>``), a greedy completion from stock
exllamav3's generator (up to ``--max-new`` tokens, ending early at an end-of-sequence token, which is not kept),
then ONE teacher-forced forward over prompt + completion that gives the top-k log-probabilities at every
completion position and after the last token (full-vocabulary log-softmax of the raw logits, computed by the
function the server uses for its own log-probabilities).

The panel is the original project's format (``reference/README.md``): a JSON list of items ``{prompt,
prompt_len, tokens, completion, top20_ids, top20_lp}``. What made it goes to a sidecar ``<panel>.meta.json``
(checkpoint, hashes of its config and index, exllamav3 version, GPU, command, date, and per prompt how often
the teacher-forced argmax differs from the greedy token), so the panel itself stays exactly that format.

No part of the project's offload layer is imported: the panel is the reference it is measured against.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

from ..models.checkpoint import config_bytes, has_config

DEFAULT_TOP_K = 20
DEFAULT_MAX_NEW = 256


def default_prompts() -> list[str]:
    return json.loads(resources.files("glm53.tools").joinpath("panel_prompts.json").read_text(encoding="utf-8"))


def load_prompts(path: Path | None) -> list[str]:
    """Prompts from a JSON list of strings (``.json``) or a text file with one prompt per non-empty line;
    the built-in list when ``path`` is None.

    :raise ValueError: an empty list, or a JSON file that is not a list of strings.
    """
    if path is None:
        return default_prompts()
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix == ".json":
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"{path}: expected a JSON list of strings")
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def prompt_ids(template, encode: Callable[[str], list[int]], text: str) -> list[int]:
    """The ids of one user turn in the thinking-off format, rendered by ``template`` (a ``ChatTemplate``)."""
    rendered = template.render([{"role": "user", "content": text}], enable_thinking=False)
    return encode(rendered.text)


def panel_item(prompt: str, ids: Sequence[int], completion: Sequence[int], rows, top_k: int, text: str) -> dict:
    """One panel item.

    :param ids: the prompt ids (P of them).
    :param completion: the greedy completion ids (N).
    :param rows: [N + 1, V] logits of the teacher-forced forward, row j predicting token P + j (the last row:
        the distribution after the final token).
    """
    from ..engine.interface import LogprobRequest
    from ..engine.sampling import logprobs_for

    tokens = list(ids) + list(completion)
    if rows.shape[0] != len(completion) + 1:
        raise ValueError(f"{rows.shape[0]} logit rows for a completion of {len(completion)} tokens; expected {len(completion) + 1}")
    chosen = [tokens[len(ids) + j] if len(ids) + j < len(tokens) else 0 for j in range(rows.shape[0])]
    entries = logprobs_for(rows, chosen, LogprobRequest(top_n=top_k))
    return {
        "prompt": prompt,
        "prompt_len": len(ids),
        "tokens": tokens,
        "completion": text,
        "top20_ids": [[t for t, _ in e.top] for e in entries],
        "top20_lp": [[round(lp, 6) for _, lp in e.top] for e in entries],
    }


def argmax_mismatches(item: dict) -> int:
    """Completion positions where the teacher-forced argmax is not the greedy (decoded) token."""
    p, tokens = item["prompt_len"], item["tokens"]
    return sum(ids[0] != tokens[p + j] for j, ids in enumerate(item["top20_ids"]) if p + j < len(tokens))


def checkpoint_facts(model_dir: Path) -> dict:
    """The checkpoint's path and the sha256 of its config.json and its shard index (or shard names and sizes)."""
    model_dir = Path(model_dir)

    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        index_hash = digest(index.read_bytes())
    else:
        listing = "\n".join(f"{p.name} {p.stat().st_size}" for p in sorted(model_dir.glob("*.safetensors")))
        index_hash = digest(listing.encode())
    return {
        "path": str(model_dir.resolve()),
        "config_sha256": digest(config_bytes(model_dir)) if has_config(model_dir) else None,
        "index_sha256": index_hash,
    }


def meta_path(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.stem + ".meta.json")


def greedy(generator, ids: Sequence[int], max_new: int, stop_ids: Sequence[int]) -> list[int]:
    """Stock exllamav3's greedy completion of ``ids`` (stopping at, and dropping, any of ``stop_ids``)."""
    from ..engine.exl3.stock import greedy_job

    generator.enqueue(greedy_job(ids, max_new, stop_conditions=list(stop_ids) or None, decode_special_tokens=True))
    out: list[int] = []
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r.get("stage") == "streaming" and r.get("token_ids") is not None:
                out += r["token_ids"][0].tolist()
    return out


def teacher_forced_rows(model, tokens: Sequence[int], prompt_len: int, vocab_size: int):
    """[len(tokens) - prompt_len + 1, V] fp32 logits from one cache-less forward; row j predicts token
    prompt_len + j."""
    import torch

    last = len(tokens) - prompt_len + 1
    with torch.inference_mode():
        logits = model.forward(torch.tensor([list(tokens)], dtype=torch.long),
                               {"attn_mode": "flash_attn_nc", "last_tokens_only": last})
    return logits[0, -last:, :vocab_size].float().cpu()


def build(model_dir: Path, out: Path, prompts: list[str], max_new: int, top_k: int, chunk_size: int,
          argv: Sequence[str], log=print) -> dict:
    """Load the checkpoint in stock exllamav3, write the panel and its sidecar, return the sidecar."""
    import torch

    from ..engine.exl3.backend import eos_token_ids
    from ..engine.exl3.patches import installed_version
    from ..engine.exl3.stock import load_stock
    from ..engine.exl3.tokenizer import HFTokenizer
    from ..models.chat_template import ChatTemplate

    started = time.monotonic()
    cache_tokens = -(-(chunk_size + max_new + 256) // 256) * 256
    stock = load_stock(model_dir, cache_tokens=cache_tokens, chunk_size=chunk_size)
    exl3_version = installed_version()
    log(f"loaded {model_dir} in stock exllamav3 {exl3_version} ({time.monotonic() - started:.1f} s)")
    tokenizer = HFTokenizer(stock.tokenizer.tokenizer, stock.vocab_size)
    template = ChatTemplate.from_model_dir(model_dir)
    stops = sorted(eos_token_ids(model_dir, stock.tokenizer))
    generator = stock.generator()
    items, per_prompt = [], []
    for i, text in enumerate(prompts):
        ids = prompt_ids(template, tokenizer.encode, text)
        if len(ids) + max_new > chunk_size:
            raise ValueError(f"prompt {i}: {len(ids)} prompt + {max_new} new tokens exceed --chunk-size {chunk_size}")
        completion = greedy(generator, ids, max_new, stops)
        rows = teacher_forced_rows(stock.model, ids + completion, len(ids), stock.vocab_size)
        item = panel_item(text, ids, completion, rows, top_k, tokenizer.decode(completion))
        items.append(item)
        per_prompt.append({"i": i, "prompt_len": len(ids), "completion_len": len(completion),
                           "positions": len(item["top20_ids"]), "argmax_mismatches": argmax_mismatches(item)})
        log(f"prompt {i}: {len(ids)} prompt + {len(completion)} completion tokens, "
            f"{per_prompt[-1]['argmax_mismatches']} teacher-forced/greedy argmax mismatches")
    generator.close()
    stock.close()
    Path(out).write_text(json.dumps(items) + "\n")
    meta = {
        "panel": Path(out).name,
        "made_by": "glm53 panel (stock exllamav3, no project patches)",
        "checkpoint": checkpoint_facts(model_dir),
        "exllamav3": exl3_version,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "command": shlex.join(argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "prompts": len(items),
        "positions": sum(p["positions"] for p in per_prompt),
        "max_new": max_new,
        "top_k": top_k,
        "stop_ids": stops,
        "chat_template": template.origin,
        "seconds": round(time.monotonic() - started, 1),
        "per_prompt": per_prompt,
    }
    meta_path(out).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def add_arguments(ap) -> None:
    ap.add_argument("-m", "--model", required=True, type=Path, help="the EXL3 checkpoint")
    ap.add_argument("--out", required=True, type=Path, help="the panel (JSON); the sidecar goes to <out stem>.meta.json")
    ap.add_argument("--prompts", type=Path, help="a JSON list of prompts, or a text file with one per line (default: 12 built-in prompts)")
    ap.add_argument("--max-new", type=int, default=DEFAULT_MAX_NEW, help=f"longest greedy completion (default {DEFAULT_MAX_NEW}; it ends early at EOS)")
    ap.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help=f"log-probabilities kept per position (default {DEFAULT_TOP_K})")
    ap.add_argument("--chunk-size", type=int, default=2048, help="longest prompt + completion (the forward is one chunk; default 2048)")


def run(ns, argv: Sequence[str] | None = None) -> int:
    if ns.max_new < 1 or ns.top_k < 1:
        print("glm53 panel: --max-new and --top-k take positive numbers", file=sys.stderr)
        return 2
    try:
        prompts = load_prompts(ns.prompts)
    except (OSError, ValueError) as exc:
        print(f"glm53 panel: {exc}", file=sys.stderr)
        return 2
    meta = build(ns.model, ns.out, prompts, ns.max_new, ns.top_k, ns.chunk_size,
                 ["glm53", *(sys.argv[1:] if argv is None else argv)], log=lambda line: print(line, flush=True))
    print(f"wrote {ns.out}: {meta['prompts']} prompts, {meta['positions']} positions; {meta_path(ns.out)}")
    return 0
