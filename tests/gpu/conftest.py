"""GPU tests: marked ``gpu``, skipped where there is no CUDA device or no exllamav3 (CI never has either).

The tiny synthetic checkpoint comes from ``TEST_CHECKPOINT`` (the runner writes it once), or is written
here into a temporary directory.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _gpu_ready() -> str | None:
    if importlib.util.find_spec("exllamav3") is None:
        return "exllamav3 is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_ready()
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    given = os.environ.get("TEST_CHECKPOINT")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    subprocess.run([sys.executable, "-m", "glm53", "synth", "--preset", "tiny", "--out", str(out), "--seed", "1"], cwd=REPO, check=True)
    return out
