"""Pinned Triton autotune picks on the GPU: a pick file recorded by ``glm53 triton-pin record`` makes two fresh
processes compute bit-identical prefill logits, and neither of them tunes anything itself.

Every step is its own process (the recording too), as a server start would be. About 15 s per process on the
H200 once Triton's cache holds the tiny checkpoint's kernels.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SIZES = ["--chunk-size", "2048", "--cache-size", "4096", "--ambs", "2"]
TOKENS = 600
# the autotuned kernels of exllamav3 1.6.5's KDA prefill (vendor/fla: l2norm, cumsum, kda_chunk_intra*, kda_wy_fast,
# chunk_delta_h, gla_chunk)
KDA_KERNELS = {"l2norm_fwd_kernel", "chunk_local_cumsum_vector_kernel", "chunk_kda_fwd_kernel_intra_token_parallel",
               "chunk_kda_fwd_kernel_inter_solve_fused", "recompute_w_u_fwd_kda_kernel",
               "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_gla_fwd_kernel_o"}


def _python(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{' '.join(args[:3])} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_two_fresh_processes_with_the_same_pins_compute_bit_identical_prefill_logits(tiny_checkpoint, tmp_path):
    pins = tmp_path / "pins.json"
    _python("glm53", "triton-pin", "record", "--model", str(tiny_checkpoint), "--out", str(pins), "--lengths", str(TOKENS), *SIZES)
    doc = json.loads(pins.read_text())
    assert tuple(doc["gpu"]["capability"]) == torch.cuda.get_device_capability()
    recorded = {kernel.split(":")[1] for kernel in doc["kernels"]}
    assert KDA_KERNELS <= recorded, f"missing: {sorted(KDA_KERNELS - recorded)}"

    runs = []
    for i in range(2):
        out = tmp_path / f"probe{i}"
        _python("tests.gpu.triton_pin_probe", "--model", str(tiny_checkpoint), "--pins", str(pins), "--out", str(out),
                "--tokens", str(TOKENS), *SIZES)
        report = json.loads((out / "report.json").read_text())
        assert report["pins"]["unpinned"] == 0, report["pins"]["unpinned_keys"]
        assert report["pins"]["pinned"] >= len(KDA_KERNELS)
        runs.append((report, torch.load(out / "rows.pt")))

    (first, rows0), (second, rows1) = runs
    assert first["shape"] == [TOKENS, second["shape"][1]]
    assert torch.equal(rows0, rows1), f"max |difference| {(rows0.float() - rows1.float()).abs().max().item()}"
    assert first["sha256"] == second["sha256"]
