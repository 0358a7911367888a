"""The project's native libraries (sources in the top-level ``native/``) as Python sees them:

- ``libraries``: where they are found and how they are built (standard library only: ``setup.py`` imports it);
- ``bindgen``: the bindings generated from the libraries' C headers, one per library (``make bindings``);
- ``cpu_binding``, ``cuda_binding``: those bindings (structs, numbers, signatures; generated, checked in);
- ``cpu``: the CPU library (the expert kernel, the CPU tier's handoff, the disk reader), found and loaded once;
- ``cuda``: the CUDA library (the expert cache's kernels and the CPU tier's device side), found and loaded once;
- ``abi``: a binding applied to a loaded library and checked against the layout and numbers the compiled library
  reports about itself (``native/abi.h``), and the error the libraries' refusals raise.

The Python APIs over them live with their users: ``offload.ec_native``, ``offload.disk``, ``cpu_tier.kernel``,
``cpu_tier.worker``, ``cpu_tier.device``. Nothing here imports another package of the project.
"""
