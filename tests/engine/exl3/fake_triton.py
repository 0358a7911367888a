"""Stand-ins for the Triton and exllamav3 autotune objects that ``glm53.engine.exl3.triton_pin`` relies on.

They copy only what triton_pin touches, as Triton 3.6 and exllamav3 1.6.5 have it: ``Config`` fields,
``Autotuner.run`` building the key (the ``key`` arguments' values, then ``str(dtype)`` of every argument with a
dtype) and reading ``self.cache``, ``configs`` and ``base_fn``; exllamav3's ``DeviceAutotune`` (one Autotuner per
device kind, made on first launch, ``_tuner``/``_tuners``); Triton's ``Heuristics`` (adds kwargs, ``.fn``).
Benchmarking is replaced by a choice that tests can change (``FakeAutotuner.winner``), so a test can play a
process whose timings differ.
"""

from __future__ import annotations

import inspect

# the device kind exllamav3's DeviceAutotune would see: (name, major, minor)
CURRENT_KIND = ("NVIDIA H200", 9, 0)


class FakeConfig:
    def __init__(self, kwargs, num_warps=4, num_stages=3, num_ctas=1, maxnreg=None, pre_hook=None, ir_override=None):
        self.kwargs = kwargs
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.num_ctas = num_ctas
        self.maxnreg = maxnreg
        self.pre_hook = pre_hook
        self.ir_override = ir_override

    def all_kwargs(self):
        extra = {"num_warps": self.num_warps, "num_ctas": self.num_ctas, "num_stages": self.num_stages, "maxnreg": self.maxnreg}
        return {**self.kwargs, **{k: v for k, v in extra.items() if v is not None}}

    def __repr__(self):
        return f"FakeConfig({self.all_kwargs()})"


class FakeJIT:
    def __init__(self, fn):
        self.fn = fn
        self.arg_names = list(inspect.signature(fn).parameters)


class FakeAutotuner:
    winner = 0  # index of the config a "benchmark" picks

    def __init__(self, fn, configs, key):
        self.fn = fn
        self.arg_names = fn.arg_names
        self.configs = configs
        self.keys = key
        self.cache = {}
        self.base_fn = fn
        while not inspect.isfunction(self.base_fn):
            self.base_fn = self.base_fn.fn
        self.benchmarked: list[tuple] = []  # keys timed
        self.launched: list[tuple] = []  # (key, config) of every launch

    def run(self, *args, **kwargs):
        nargs = dict(zip(self.arg_names, args))
        all_args = {**nargs, **kwargs}
        named = {k: v for k, v in all_args.items() if k in self.arg_names}
        key = [named[k] for k in self.keys if k in named]
        key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        key = tuple(key)
        if key not in self.cache:
            self.benchmarked.append(key)
            self.cache[key] = self.configs[type(self).winner % len(self.configs)]
        config = self.cache[key]
        self.launched.append((key, config))
        return config


class FakeDeviceAutotune:
    def __init__(self, fn, kwargs):
        self.fn = fn
        self.arg_names = fn.arg_names
        self._kwargs = kwargs
        self._tuners = {}

    def _tuner(self, args, kwargs):
        tuner = self._tuners.get(CURRENT_KIND)
        if tuner is None:
            configs = self._kwargs["configs"]
            tuner = self._tuners[CURRENT_KIND] = FakeAutotuner(self.fn, configs(CURRENT_KIND) if callable(configs) else configs, self._kwargs["key"])
        return tuner

    def run(self, *args, **kwargs):
        return self._tuner(args, kwargs).run(*args, **kwargs)


class FakeHeuristics:
    def __init__(self, fn, values):
        self.fn = fn
        self.values = values
        self.arg_names = fn.arg_names

    def run(self, *args, **kwargs):
        for name, heuristic in self.values.items():
            kwargs[name] = heuristic({**dict(zip(self.arg_names, args)), **kwargs})
        return self.fn.run(*args, **kwargs)
