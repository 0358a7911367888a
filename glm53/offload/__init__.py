"""The offload core: where each routed expert lives and how the GPU reads it (host store, GPU expert cache, prefill
staging, the elastic loan) and the binding of the cache's CUDA kernels (``ec_native``)."""
