"""A checkpoint in stock exllamav3, set up the way its own ``model_init`` does, for the reference tools
(``glm53 panel``, ``bench/decode_kl.py``, ``bench/compare.py``).

Nothing of the project's offload layer is imported here: what this loads is the baseline the project is measured
against. Only exllamav3's public API is used, plus two ``config.infer_params`` fields that its ``model_init``
sets for ``-mcs`` and ``-mcpa`` (``exllamav3/model_init.py`` in 1.6.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StockModel:
    config: object  # exllamav3.Config
    model: object  # exllamav3.Model
    caches: list = field(default_factory=list)  # exllamav3.Cache, all attached before the load
    tokenizer: object = None  # exllamav3.Tokenizer
    chunk_size: int = 2048

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def generator(self, cache_index: int = 0, max_batch_size: int = 1):
        """A stock generator over one of the caches (a cache serves one generator)."""
        from exllamav3 import Generator

        return Generator(self.model, self.caches[cache_index], self.tokenizer, max_batch_size=max_batch_size,
                         max_chunk_size=self.chunk_size)

    def close(self) -> None:
        self.model.unload()


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
) -> StockModel:
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
    from exllamav3 import Cache, CacheLayer_fp16, Config, Model, Tokenizer

    config = Config.from_directory(str(model_dir))
    if moe_cpu_split:
        config.infer_params.moe_cpu_split = moe_cpu_split
    if moe_cpu_threads is not None:
        config.infer_params.moe_cpu_threads = moe_cpu_threads
    if pinned_arena:
        config.infer_params.moe_cpu_pinned_arena = True
    model = Model.from_config(config)
    # exllamav3 measures a whole chunk through the first cache while loading: a cache smaller than the prefill
    # chunk fails its "Cache too small for batch shape" assertion, so the chunk is capped to the cache
    chunk_size = min(chunk_size, cache_tokens)
    # caches allocate their tensors when the model loads, so all of them exist before load()
    made = [Cache(model, max_num_tokens=cache_tokens, layer_type=CacheLayer_fp16, max_batch_size=max_batch_size)
            for _ in range(caches)]
    model.load(progressbar=False, max_batch_size=max_batch_size, max_chunk_size=chunk_size)
    if warmup:
        model.warmup(cache=made[0], max_chunk_size=chunk_size, progressbar=False)
    return StockModel(config, model, made, Tokenizer.from_config(config), chunk_size)
