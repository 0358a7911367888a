"""The README's two commands: ``make demo`` passes extra server arguments through ``ARGS``."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_make_demo_appends_args_to_the_server_command():
    # -n prints the recipe without running it; its last line is the server command
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # also under `make test`
    out = subprocess.run(["make", "-n", "--no-print-directory", "demo", "ARGS=--port 38123 --max-batch-size 2"], cwd=REPO,
                         env=env, capture_output=True, text=True, check=True).stdout
    assert shlex.split(out.strip().splitlines()[-1]) == [".venv/bin/glm53", "serve", "--port", "38123", "--max-batch-size", "2"]


def test_the_readme_starts_with_the_two_commands_and_says_how_to_pass_arguments():
    readme = (REPO / "README.md").read_text()
    block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in block.splitlines()] == [["make", "demo"], ["make", "test"]]
    assert 'make demo ARGS="--port 38123"' in readme
