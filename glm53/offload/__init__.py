"""The offload core: where each routed expert lives and how the GPU reads it.

- ``host_store``: every expert's trellises once, in page-locked host memory the GPU reads over the link;
- ``ram_tier``: where host RAM cannot hold every expert, slots over the checkpoint's files replaced by the cache's
  policy (not yet on the GPU decode path);
- ``disk``: the binding of the native disk reader (``native/disk``): O_DIRECT reads of the checkpoint's files;
- ``cache``: the GPU expert cache (VRAM slots, the replacement policy, the elastic loan of cold slots);
- ``ec_native``: the ctypes binding of the cache's CUDA kernels (``native/ec/expert_cache.cu``);
- ``staging``: prefill's copies of a layer's non-resident experts into VRAM, one layer ahead;
- ``budget``: how many cache slots the VRAM budget leaves, and the headroom staging may use;
- ``profile``: the routing profile the cache starts from (the checkpoint's, else one learned while serving);
- ``prefetch``: the decode's predictive prefetch into a small VRAM pool (``prefetch_policy``: its policy);
- ``part``: the hook protocol of the offload's optional parts (the cache, prefetch, the CPU tier);
- ``runtime``: the running offload (``Offload``): what the model's hooks call (its parts, in a loop), statistics
  and shutdown.

Nothing here imports exllamav3 or the CPU tier: ``glm53.engine.exl3.offload`` starts the offload on a model and
installs the hooks, and hands the CPU tier (``glm53.cpu_tier``) the host store and the cache.
"""
