"""Put on PYTHONPATH (ahead of the repository root) for a stock-exllamav3 CPU-offload arm only: installs the Python
``exl3_moe_cpu_core_order`` (``glm53/engine/exl3/core_order.py``) in every interpreter of that arm, including the
CPU worker that exllamav3 starts with multiprocessing's spawn method. Then runs the ``sitecustomize`` this one
shadows."""

import importlib.machinery
import importlib.util
import os
import sys

from glm53.engine.exl3.core_order import install_import_hook

install_import_hook()

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
