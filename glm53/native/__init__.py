"""The project's native libraries (sources in the top-level ``native/``) as Python sees them:

- ``libraries``: where they are found and how they are built (standard library only: ``setup.py`` imports it);
- ``cpu``: the CPU library (the expert kernel, the CPU tier's handoff, the disk reader), found once;
- ``cuda``: the CUDA library (the expert cache's kernels and the CPU tier's device side), found and loaded once;
- ``abi``: the check of the ctypes mirrors of C structs, and of the numbers both sides share, against the layout
  the compiled library reports about itself (``native/abi.h``).

The bindings live with their users: ``offload.ec_native``, ``offload.disk``, ``cpu_tier.kernel``, ``cpu_tier.worker``,
``cpu_tier.device``. Nothing here imports another package of the project.
"""
