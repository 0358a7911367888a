"""Every contact with exllamav3 (imported only when ``--engine exl3`` is chosen or a GPU tool runs: it needs CUDA
and exllamav3 1.6.5). Nothing else in glm53 imports exllamav3; bench and tests use the functions here.

- ``load``: the one load function (config, model, caches, ``Model.load``, warm-up, tokenizer), with the offload
  started inside it;
- ``offload``: the offload's start on a model, step by step (``start_offload``);
- ``backend``: the ``Backend`` the scheduler drives (``Exl3Backend``), with ``tokenizer`` and ``grammar_filter``;
- ``patches``: the patch points in exllamav3's model internals (the MoE layers, their expert pointer tables, the
  routing and routed-sum hooks, the fused expert kernel), the version they were written against and its check;
- ``prefill``: the patch points in its generator (single-pass prefill, the recurrent checkpoint at a prompt's end);
- ``triton_pin``, ``triton_pin_file``: pinned Triton autotune picks of its KDA kernels and their file (recorded by
  ``glm53/tools/triton_pin_record.py``);
- ``stock``: the stock reference the project is measured against (``load_stock``) and the tools' jobs;
- ``core_order``: a stand-in for its C++ core-order function, for the stock CPU-offload baselines of bench.
"""
