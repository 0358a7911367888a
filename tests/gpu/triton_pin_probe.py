"""One fresh process of ``test_triton_pin.py``: install a pick file, load the model as the server does, run one
teacher-forced prefill, and write what it computed.

    python -m tests.gpu.triton_pin_probe --model DIR --pins FILE --out DIR [--tokens 600] [--seed 0] ...

Writes ``report.json`` (the pins' report, the SHA-256 of the whole logits tensor, its shape and dtype) and
``rows.pt`` (every 16th position's logits, for a readable difference when two processes disagree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

import torch

from glm53.engine.exl3 import triton_pin
from glm53.engine.exl3.triton_pin_record import forward_nc, load_stock

ROW_STRIDE = 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="triton_pin_probe")
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--pins", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--cache-size", type=int, default=4096)
    ap.add_argument("--ambs", type=int, default=2)
    ns = ap.parse_args(argv)

    report = triton_pin.install(ns.pins)  # before the load: warmup already launches the KDA kernels
    stock = load_stock(ns.model, cache_size=ns.cache_size, chunk_size=ns.chunk_size, ambs=ns.ambs, max_batch_size=ns.ambs)
    rng = random.Random(ns.seed)
    ids = [rng.randrange(stock.vocab_size) for _ in range(ns.tokens)]
    logits = forward_nc(stock.model, ids)[0].contiguous()  # [tokens, vocab]
    digest = hashlib.sha256(logits.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    ns.out.mkdir(parents=True, exist_ok=True)
    torch.save(logits[::ROW_STRIDE].cpu().clone(), ns.out / "rows.pt")
    (ns.out / "report.json").write_text(json.dumps({"pins": report.as_dict(), "sha256": digest, "shape": list(logits.shape),
                                                    "dtype": str(logits.dtype)}))
    stock.generator.close()
    stock.model.unload()
    return 0


if __name__ == "__main__":
    sys.exit(main())
