"""One fresh process of ``test_triton_pin.py``: load the model through ``Exl3Backend`` with ``--triton-pin FILE``, as
the server does (the backend installs the picks before its load), run one teacher-forced prefill, and write what it
computed.

    python -m tests.gpu.triton_pin_probe --model DIR --pins FILE --out DIR [--tokens 600] [--seed 0] ...

Writes ``report.json`` (the pins' report as the backend's stats give it, the SHA-256 of the whole logits tensor, its
shape and dtype) and ``rows.pt`` (every 16th position's logits, for a readable difference when two processes
disagree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

import torch

from glm53 import config
from glm53.engine.exl3.backend import Exl3Backend
from glm53.tools.triton_pin_record import forward_nc

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

    # the recorder's sizes, in exact mode (no CPU tier to measure at start); no GLM53_* variable of this process
    settings = config.load(["--engine", "exl3", "--mode", "exact", "-m", str(ns.model), "--triton-pin", str(ns.pins),
                            "--chunk-size", str(ns.chunk_size), "--cache-size", str(ns.cache_size), "--ambs", str(ns.ambs),
                            "--max-batch-size", str(ns.ambs)], {})
    backend = Exl3Backend(settings)
    rng = random.Random(ns.seed)
    ids = [rng.randrange(backend.info.vocab_size) for _ in range(ns.tokens)]
    logits = forward_nc(backend.model, ids)[0].contiguous()  # [tokens, vocab]
    digest = hashlib.sha256(logits.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    ns.out.mkdir(parents=True, exist_ok=True)
    torch.save(logits[::ROW_STRIDE].cpu().clone(), ns.out / "rows.pt")
    (ns.out / "report.json").write_text(json.dumps({"pins": backend.stats()["triton_pins"], "sha256": digest,
                                                    "shape": list(logits.shape), "dtype": str(logits.dtype)}))
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
