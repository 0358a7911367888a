"""The one-way imports of DESIGN.md's "Layout" table, as ``pyproject.toml``'s import-linter contracts state them
(layers server -> engine -> offload | cpu_tier -> native | models -> config | progress; exllamav3 and Triton only
from glm53.engine.exl3): ``lint-imports`` keeps every contract."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_import_contract_is_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    assert lint.exists(), f"{lint} is missing: import-linter is in the dev extra (pip install -e '.[dev]')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([str(lint), "--no-cache"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
