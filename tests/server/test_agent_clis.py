"""The two agent CLIs, as their users run them, against a real server with a scripted model: Claude Code in print
mode over ``/v1/messages`` and Codex CLI's ``codex exec`` over ``/v1/responses``. In one scripted turn the model
calls the CLI's own shell tool, the CLI runs the command and sends its output back, and the model's answer quotes
it. The CLIs are the pinned npm packages ``make agent-clis`` installs into ``.npm-tools/`` (native binaries).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .scripted_server import AGENT_ANSWER
from .servers import REPO, Server

BIN = REPO / ".npm-tools" / "node_modules" / ".bin"
KEY = "sk-test-agents"
MODEL = "glm-5.3-flash"
RAN = "glm53-42"  # what the scripted command prints (its text is `echo glm53-$((6*7))`)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server():
    # the CLIs' prompts are long (tens of thousands of byte tokens for the scripted model's tokenizer)
    s = Server(["--max-batch-size", "2", "-cs", "262144"], env={"GLM53_API_KEY": KEY}, module="tests.server.scripted_server").wait_ready()
    yield s
    s.stop()


def cli(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: `make test` installs it (make agent-clis)")
        pytest.skip(f"{path} is missing: run `make agent-clis`")
    return path


def run(argv: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    # a clean environment: nothing of the developer's own CLI configuration or keys reaches the run
    base = {k: os.environ[k] for k in ("PATH", "LANG", "TMPDIR") if k in os.environ}
    return subprocess.run([str(a) for a in argv], env={**base, **env}, cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def requests_logged(server, path: str) -> int:
    return sum(1 for line in server.log().splitlines() if f"POST {path} 200" in line)


def test_claude_code_runs_its_bash_tool_and_reports_the_output(server, tmp_path):
    claude = cli("claude")
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY, "ANTHROPIC_MODEL": MODEL,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    before = requests_logged(server, "/v1/messages")
    done = run([claude, "-p", "[[script:claude_bash]] print the number", "--allowedTools", "Bash", "--max-turns", "3"], env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == AGENT_ANSWER + RAN
    assert requests_logged(server, "/v1/messages") - before == 2  # the call, then the answer to its result


def test_codex_exec_runs_its_shell_tool_and_reports_the_output(server, tmp_path):
    codex = cli("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "glm53"\n\n[model_providers.glm53]\nname = "glm53"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\nenv_key = "GLM53_API_KEY"\n')
    env = {"HOME": str(tmp_path), "CODEX_HOME": str(home), "GLM53_API_KEY": KEY}
    before = requests_logged(server, "/v1/responses")
    # the command is a harmless echo; the sandbox (bubblewrap) needs user namespaces that CI containers may lack
    done = run([codex, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                "[[script:codex_exec]] print the number"], env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    answer = done.stdout.strip()
    assert answer.startswith(AGENT_ANSWER) and answer.splitlines()[-1] == RAN, answer
    assert requests_logged(server, "/v1/responses") - before == 2
