"""The tools beside the server, behind ``glm53``'s other commands; nothing that serves imports them.

- ``synth``: ``glm53 synth``, synthetic GLM-5.3-Flash checkpoints (the real shapes and EXL3 format, random values);
- ``calibrate_router``: ``glm53 calibrate-router``, a synthetic checkpoint's router biases fitted on stock exllamav3;
- ``panel``: ``glm53 panel``, a reference panel made by stock exllamav3 (for ``bench/score_ref_panel.py``);
- ``triton_pin_record``: ``glm53 triton-pin``, the Triton autotune picks a model's prefills make, recorded and shown.

The ones that run a model do it through ``glm53.engine.exl3``'s functions (its stock load, its patch points), never
through exllamav3's internals.
"""
