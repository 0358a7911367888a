"""A checkpoint in stock exllamav3, set up the way its own ``model_init`` does, for the reference tools
(``glm53 panel``, ``glm53 triton-pin record``, ``bench/decode_kl.py``, ``bench/compare.py``) and the GPU tests;
and the generator jobs those tools run.

Nothing of the project's offload layer is involved: what this loads is the baseline the project is measured
against. Only exllamav3's public API is used, plus two ``config.infer_params`` fields that its ``model_init``
sets for ``-mcs`` and ``-mcpa`` (``exllamav3/model_init.py`` in 1.6.5) and the CPU worker's thread count
(``exllamav3.model.moe_cpu_host.TUNING``) for the record.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from .load import Loaded, load

StockModel = Loaded  # what load_stock returns: config, model, caches, tokenizer, chunk_size; generator(), close()


def load_stock(
    model_dir: Path,
    *,
    cache_tokens: int = 8192,
    caches: int = 1,
    max_batch_size: int = 1,
    chunk_size: int = 2048,
    moe_cpu_split: int = 0,
    moe_cpu_threads: int | None = None,
    pinned_arena: bool = False,
    warmup: bool = True,
) -> Loaded:
    """Load ``model_dir`` on the GPU with ``caches`` fp16 caches of ``cache_tokens`` tokens each.

    :param max_batch_size: recurrent-state slots per cache (sequences one cache holds at once).
    :param moe_cpu_split: exllamav3's ``-mcs N``: the last N routed experts of every MoE layer run on its CPU
        worker (with ``EXL3_MOE_CPU_SPLIT_STATS`` in the environment, the coldest N).
    :param moe_cpu_threads: ``-mct``: the CPU worker's threads (None: exllamav3's default).
    :param pinned_arena: ``-mcpa``: the worker's expert arena in shared page-locked memory.
    :param warmup: run exllamav3's warm-up passes (kernel compilation, autotuning) after the load, as
        ``model_init`` does.
    :raise AssertionError, RuntimeError: from exllamav3, e.g. a checkpoint that does not fit the GPU.
    """
    infer_params = {}
    if moe_cpu_split:
        infer_params["moe_cpu_split"] = moe_cpu_split
    if moe_cpu_threads is not None:
        infer_params["moe_cpu_threads"] = moe_cpu_threads
    if pinned_arena:
        infer_params["moe_cpu_pinned_arena"] = True
    # exllamav3 measures a whole chunk through the first cache while loading: a cache smaller than the prefill
    # chunk fails its "Cache too small for batch shape" assertion, so the chunk is capped to the cache
    return load(model_dir, cache_tokens=cache_tokens, cache_batch=[max_batch_size] * caches, chunk_size=min(chunk_size, cache_tokens),
                infer_params=infer_params, warmup=warmup)


def cpu_worker_threads(stock: Loaded) -> int | None:
    """The threads of stock's CPU worker (``-mct``, else what exllamav3 chose); None when it has not started one."""
    host = sys.modules.get("exllamav3.model.moe_cpu_host")
    return stock.config.infer_params.moe_cpu_threads or (host.TUNING.threads if host else None)


def greedy_job(ids: Sequence[int], max_new_tokens: int | None, **options):
    """An exllamav3 job decoding ``ids`` greedily (argmax, as stock does for temperature 0); ``options`` are more of
    ``Job``'s arguments (``identifier``, ``stop_conditions``, ``decode_special_tokens``, ``return_logits``)."""
    import torch
    from exllamav3 import ArgmaxSampler, Job

    return Job(input_ids=torch.tensor([list(ids)], dtype=torch.long), max_new_tokens=max_new_tokens, sampler=ArgmaxSampler(), **options)


def sampled_job(ids: Sequence[int], max_new_tokens: int | None, temperature: float, seed: int, **options):
    """An exllamav3 job sampling at ``temperature`` with its own ``seed`` (exllamav3's ComboSampler, no other
    truncation); ``options`` as :func:`greedy_job`'s."""
    import torch
    from exllamav3 import ComboSampler, Job

    return Job(input_ids=torch.tensor([list(ids)], dtype=torch.long), max_new_tokens=max_new_tokens,
               sampler=ComboSampler(temperature=temperature), seed=seed, **options)
