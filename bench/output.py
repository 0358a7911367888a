"""How the measurement tools hand over their results."""

from __future__ import annotations

import json
from pathlib import Path


def emit_json(result: dict, out: str | Path | None) -> None:
    """The result as indented JSON: into ``out`` when given, else on standard output."""
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    else:
        print(text)
