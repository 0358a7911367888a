"""The offload layer: where each routed expert lives (pinned host store, GPU expert cache, staging, CPU tier).

``exl3_patch`` is the one module that reaches into exllamav3's internals.
"""
