"""Synthetic GLM-5.3-Flash checkpoints: exllamav3's EXL3 format and the real shapes, random values.

``glm53 synth`` (``writer.write_checkpoint``) writes one. The modules, in the order a write uses them:
``presets`` (the shapes, the value scales and the routing presets), ``router`` (expert popularity from the routing
profile, the bias fit and calibration), ``routing`` (the routing dynamics: gates on a shared low-rank routing
subspace and their CPU twin), ``tensors`` (every tensor and how its values are made), ``random_pool`` (fast
deterministic random bytes), ``safetensors_file`` (the streaming writer), ``metadata`` and
``tokenizer_files`` (the JSON files), ``exl3_reference`` (a NumPy decoder to check written EXL3 tensors).
"""
