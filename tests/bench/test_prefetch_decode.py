"""bench/prefetch_decode.py's bookkeeping on the CPU (the runs themselves need a GPU: tests/gpu/test_bench_tools.py)."""

from __future__ import annotations

import torch

from bench.prefetch_decode import layer_figures
from glm53.offload.cache_policy import C_ADMITS, C_HITS, C_N, C_PICKS
from glm53.offload.ec_native import PF_COUNTERS


def test_recall_precision_and_link_bytes_per_step_come_from_the_counters_differences():
    cache0, pf0 = torch.zeros((2, C_N), dtype=torch.int64), torch.zeros((2, len(PF_COUNTERS)), dtype=torch.int64)
    cache1, pf1 = cache0.clone(), pf0.clone()
    cache0[:, C_PICKS] = 5  # counts before the run do not count
    cache1[0, C_PICKS], cache1[0, C_HITS], cache1[0, C_ADMITS] = 5 + 16, 4, 1  # layer 0: 12 missed picks, 1 admission
    cache1[1, C_PICKS], cache1[1, C_HITS] = 5 + 16, 16  # layer 1: all hits
    col = {n: i for i, n in enumerate(PF_COUNTERS)}
    pf1[0, col["copied"]], pf1[0, col["used"]], pf1[0, col["wasted"]] = 4, 3, 1
    got = layer_figures(cache0, cache1, pf0, pf1, steps=2, block_bytes=1_000_000)
    assert got["layers"][0] == {"missed_picks": 12, "prefetch_used": 3, "prefetch_copied": 4, "prefetch_wasted": 1,
                                "recall": 0.25, "precision": 0.75}
    assert got["layers"][1]["recall"] is None and got["layers"][1]["precision"] is None
    # 12 misses, 3 of them from the pool, 4 copies and 1 admission over the link: 14 MB in 2 steps
    assert (got["missed_picks"], got["prefetch_used"], got["recall"], got["link_mb_per_step"]) == (12, 3, 0.25, 7.0)
