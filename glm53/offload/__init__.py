"""The offload core: where each routed expert lives and how the GPU reads it.

- ``host_store``: every expert's trellises once, in page-locked host memory the GPU reads over the link;
- ``cache``: the GPU expert cache (VRAM slots, the replacement policy, the elastic loan of cold slots);
- ``ec_native``: the ctypes binding of the cache's CUDA kernels (``native/ec/expert_cache.cu``);
- ``staging``: prefill's copies of a layer's non-resident experts into VRAM, one layer ahead;
- ``budget``: how many cache slots the VRAM budget leaves, and the headroom staging may use;
- ``profile``: the routing profile the cache starts from (the checkpoint's, else one learned while serving);
- ``runtime``: the running offload (``Offload``): what the model's hooks call, statistics and shutdown.

Nothing here imports exllamav3 or the CPU tier: ``glm53.engine.exl3.offload`` starts the offload on a model and
installs the hooks, and hands the CPU tier (``glm53.cpu_tier``) the host store and the cache.
"""
