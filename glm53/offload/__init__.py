"""The offload layer: where each routed expert lives (pinned host store, GPU expert cache, staging, CPU tier).

``exl3_patch`` is the one module that reaches into exllamav3's model internals; ``triton_pin`` also reaches into
exllamav3's per-device Triton autotune wrapper (and Triton's ``Autotuner``), and lists what it relies on.
"""
