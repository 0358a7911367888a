"""Run a bench tool as a subprocess, the way a person runs it, and read the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.server.servers import REPO


def run_tool(script: str, out: Path, *args: str, timeout: float = 120) -> tuple[int, dict | None, str]:
    """Exit status, the result JSON (None when the tool wrote none) and stderr of ``bench/<script>``."""
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", *args, "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )
    result = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, result, proc.stdout + proc.stderr
