"""The one load function (glm53.engine.exl3.load) and the stock reference built on it, against a stand-in exllamav3
that records every call: the order (config, model, caches, load, warm-up, tokenizer), the arguments the backend,
the stock tools and calibration pass, and an offload started inside it. The real load runs on the GPU
(tests/gpu/test_exl3_backend.py, test_offload_exact.py)."""

from __future__ import annotations

import sys
import types

import pytest

from glm53.engine.exl3 import stock
from glm53.engine.exl3.load import load
from glm53.progress import Progress


@pytest.fixture
def exl3(monkeypatch):
    """A stand-in ``exllamav3`` package; ``calls`` lists what was done, in order."""
    calls = []

    class Config:
        vocab_size = 100

        def __init__(self):
            self.infer_params = types.SimpleNamespace(moe_cpu_split=0, moe_cpu_threads=None, moe_cpu_pinned_arena=False)

        @classmethod
        def from_directory(cls, path):
            calls.append(("config", path))
            return cls()

    class Model:
        @classmethod
        def from_config(cls, config):
            calls.append(("model", dict(vars(config.infer_params))))
            model = cls()
            model.config = config
            return model

        def load(self, **kwargs):
            calls.append(("load", {k: v for k, v in kwargs.items() if k != "callback"}, kwargs["callback"] is not None))

        def warmup(self, **kwargs):
            calls.append(("warmup", kwargs["cache"].index, kwargs["max_chunk_size"]))

        def unload(self):
            calls.append(("unload",))

    class Cache:
        made = 0

        def __init__(self, model, max_num_tokens, layer_type, max_batch_size):
            self.index, Cache.made = Cache.made, Cache.made + 1
            calls.append(("cache", max_num_tokens, layer_type.__name__, max_batch_size))

    class CacheLayer_fp16:  # noqa: N801 (exllamav3's name)
        pass

    class Tokenizer:
        @classmethod
        def from_config(cls, config):
            calls.append(("tokenizer",))
            return cls()

    class Generator:
        def __init__(self, model, cache, tokenizer, **kwargs):
            calls.append(("generator", cache.index, kwargs))

    module = types.ModuleType("exllamav3")
    for cls in (Config, Model, Cache, CacheLayer_fp16, Tokenizer, Generator):
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "exllamav3", module)
    return calls


def test_the_stock_reference_loads_as_model_init_does(exl3, tmp_path):
    s = stock.load_stock(tmp_path, cache_tokens=1024, caches=2, max_batch_size=3, chunk_size=2048, moe_cpu_split=4, pinned_arena=True)
    assert exl3 == [
        ("config", str(tmp_path)),
        ("model", {"moe_cpu_split": 4, "moe_cpu_threads": None, "moe_cpu_pinned_arena": True}),
        ("cache", 1024, "CacheLayer_fp16", 3), ("cache", 1024, "CacheLayer_fp16", 3),
        # the chunk capped to the cache, which exllamav3 measures it through
        ("load", {"use_per_device": None, "progressbar": False, "max_batch_size": 3, "max_chunk_size": 1024}, True),
        ("warmup", 0, 1024),
        ("tokenizer",),
    ]
    assert s.chunk_size == 1024 and s.vocab_size == 100 and s.offload is None and len(s.caches) == 2
    s.generator(cache_index=1, max_batch_size=3)
    assert exl3[-1] == ("generator", 1, {"max_batch_size": 3, "max_chunk_size": 1024})
    s.close()
    assert exl3[-1] == ("unload",)


def test_without_warmup_the_model_is_only_loaded(exl3, tmp_path):
    load(tmp_path, cache_tokens=4096, cache_batch=[8], warmup=False)
    assert [c[0] for c in exl3] == ["config", "model", "cache", "load", "tokenizer"]
    assert exl3[3][1]["max_chunk_size"] == 2048 and exl3[3][1]["max_batch_size"] == 8


def test_an_offload_runs_the_load_and_the_warmup_itself(exl3, tmp_path):
    seen = []

    def offload(model, load_model, warmup):
        seen.append([c[0] for c in exl3])  # made, caches attached, not loaded
        load_model()
        seen.append("between")
        warmup()
        return "the offload"

    progress = Progress()
    loaded = load(tmp_path, cache_tokens=4096, cache_batch=[4, 1, 1], chunk_size=512, gpu_split=[20.0], offload=offload, progress=progress)
    assert seen == [["config", "model", "cache", "cache", "cache"], "between"]
    assert [c[0] for c in exl3] == ["config", "model", "cache", "cache", "cache", "load", "warmup", "tokenizer"]
    assert exl3[5][1] == {"use_per_device": [20.0], "progressbar": False, "max_batch_size": 4, "max_chunk_size": 512}
    assert [c[3] for c in exl3[2:5]] == [4, 1, 1] and exl3[6] == ("warmup", 0, 512)
    assert loaded.offload == "the offload" and loaded.caches[0].index == 0


def test_jobs_for_the_tools(monkeypatch):
    made = []
    module = types.ModuleType("exllamav3")
    module.Job = lambda **kwargs: made.append(kwargs) or kwargs
    module.ArgmaxSampler = lambda: "argmax"
    module.ComboSampler = lambda temperature: ("combo", temperature)
    monkeypatch.setitem(sys.modules, "exllamav3", module)
    stock.greedy_job([5, 6], 7, identifier=3, decode_special_tokens=True)
    stock.sampled_job((1, 2, 3), 9, temperature=1.0, seed=11)
    assert made[0]["input_ids"].tolist() == [[5, 6]] and str(made[0]["input_ids"].dtype) == "torch.int64"
    assert {k: v for k, v in made[0].items() if k != "input_ids"} == {"max_new_tokens": 7, "sampler": "argmax", "identifier": 3,
                                                                      "decode_special_tokens": True}
    assert {k: v for k, v in made[1].items() if k != "input_ids"} == {"max_new_tokens": 9, "sampler": ("combo", 1.0), "seed": 11}
