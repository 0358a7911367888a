"""Fast mode's CPU tier: the coldest missed experts of a decode step computed on host cores from the host store.

- ``kernel``: the ctypes binding of the CPU expert kernel (``native/cpu_expert``) and its thread pool;
- ``worker``: the job ring in host memory, the expert table and the host worker (``native/cpu_tier``);
- ``device``: the GPU side of the handoff (``native/ec/cpu_tier_device.cuh``): publish, collect, the GPU fallback;
- ``split``: the cost model that splits a step's misses between the GPU and the CPU, and its host reference;
- ``measure``: the cost model's constants measured at start (``measure_costs``);
- ``tuning``: how the tier follows the host between steps (``Tuning``, frozen; a running tier can be retuned);
- ``controller``: that following itself (``Controller``: running, resting, probing, refreshing), fed counters;
- ``tier``: the tier put together in a running offload (``FastTier``, one of its parts): the per-layer hooks.

It imports nothing of the offload core or of exllamav3: the engine hands it the host store, the cache's device
tensors and the GPU fallback kernel (``glm53.engine.exl3.offload``).
"""
