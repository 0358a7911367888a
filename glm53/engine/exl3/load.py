"""The one way a checkpoint is loaded into exllamav3, for the backend, the stock reference (``stock``), calibration,
the Triton pin recorder and the bench tools:

    Config.from_directory -> Model.from_config -> the caches (all before the load, which allocates them)
    -> Model.load -> Model.warmup -> Tokenizer.from_config

The offload starts inside it: ``offload(model, load, warmup)`` is handed the model before its load and the two
steps to run (``glm53.engine.exl3.offload.start_offload`` runs the load with its experts answered from the host
store, the warm-up, then builds the cache on the VRAM that is left).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...progress import Progress


@dataclass
class Loaded:
    config: Any  # exllamav3.Config
    model: Any  # exllamav3.Model
    caches: list = field(default_factory=list)  # exllamav3.Cache, all attached before the load
    tokenizer: Any = None  # exllamav3.Tokenizer
    chunk_size: int = 2048
    offload: Any = None  # what ``load``'s ``offload`` returned (the backend's ``Offload``), else None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def generator(self, cache_index: int = 0, max_batch_size: int = 1, **options):
        """An exllamav3 generator over one of the caches (a cache serves one generator); ``options`` are more of
        ``Generator``'s arguments (the recurrent checkpoints')."""
        from exllamav3 import Generator

        return Generator(self.model, self.caches[cache_index], self.tokenizer, max_batch_size=max_batch_size,
                         max_chunk_size=self.chunk_size, **options)

    def close(self) -> None:
        self.model.unload()


def load(
    model_dir: Path,
    *,
    cache_tokens: int,
    cache_batch: Sequence[int] = (1,),
    chunk_size: int = 2048,
    gpu_split: list[float] | None = None,
    infer_params: Mapping[str, Any] | None = None,
    warmup: bool = True,
    offload: Callable[[Any, Callable[[], None], Callable[[], None]], Any] | None = None,
    progress: Progress | None = None,
) -> Loaded:
    """Load ``model_dir`` on the GPU with one fp16 cache of ``cache_tokens`` tokens per entry of ``cache_batch``.

    :param cache_batch: each cache's recurrent-state slots (sequences it holds at once); the first is the load's
        and the warm-up's ``max_batch_size``.
    :param chunk_size: the prefill chunk the load measures and the warm-up and generators use (exllamav3 measures
        a whole chunk through the first cache: it must fit it).
    :param gpu_split: ``Model.load``'s ``use_per_device`` (GB per device); None for exllamav3's default.
    :param infer_params: fields of ``config.infer_params`` to set before the model is made (stock's ``-mcs``...).
    :param warmup: run exllamav3's warm-up passes (kernel compilation, autotuning) after the load.
    :param offload: called as ``offload(model, load, warmup)`` instead of running the two steps here; what it
        returns is ``Loaded.offload``.
    :param progress: where the load ("loading the model") and the warm-up ("warming up") report.
    :raise AssertionError, RuntimeError: from exllamav3, e.g. a checkpoint that does not fit the GPU.
    """
    from exllamav3 import Cache, CacheLayer_fp16, Config, Model, Tokenizer

    progress = progress or Progress()
    config = Config.from_directory(str(model_dir))
    for name, value in (infer_params or {}).items():
        setattr(config.infer_params, name, value)
    model = Model.from_config(config)
    caches = [Cache(model, max_num_tokens=cache_tokens, layer_type=CacheLayer_fp16, max_batch_size=slots) for slots in cache_batch]

    def load_model() -> None:
        model.load(use_per_device=gpu_split, progressbar=False, max_batch_size=cache_batch[0], max_chunk_size=chunk_size,
                   callback=progress.steps("loading the model", "modules"))

    def warm_up() -> None:
        if warmup:
            model.warmup(cache=caches[0], max_chunk_size=chunk_size, progressbar=False, callback=progress.steps("warming up", "passes"))

    attached = None
    if offload is None:
        load_model()
        warm_up()
    else:
        attached = offload(model, load_model, warm_up)
    return Loaded(config, model, caches, Tokenizer.from_config(config), chunk_size, attached)


def page_size() -> int:
    """exllamav3's cache page, in tokens."""
    from exllamav3.constants import PAGE_SIZE

    return PAGE_SIZE
