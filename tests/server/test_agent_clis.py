"""The two agent CLIs, as their users run them, against a real server with a scripted model: Claude Code in print
mode over ``/v1/messages`` and Codex CLI's ``codex exec`` over ``/v1/responses``. In one scripted turn the model
calls the CLI's own shell tool, the CLI runs the command and sends its output back, and the model's answer quotes
it. The CLIs are the pinned npm packages ``make agent-clis`` installs into ``.npm-tools/`` (native binaries). Claude
Code also runs one such turn through the fleet's front proxy (nginx, ``bench/fleet.py``) over two servers.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from bench.fleet import FrontProxy, box_for_session

from .scripted_server import AGENT_ANSWER
from .servers import REPO, Server

BIN = REPO / ".npm-tools" / "node_modules" / ".bin"
KEY = "sk-test-agents"
MODEL = "glm-5.3-flash"
RAN = "glm53-42"  # what the scripted command prints (its text is `echo glm53-$((6*7))`)
TIMEOUT_S = 120


def scripted_server() -> Server:
    # the CLIs' prompts are long (tens of thousands of byte tokens for the scripted model's tokenizer)
    return Server(["--max-batch-size", "2", "-cs", "262144"], env={"GLM53_API_KEY": KEY}, module="tests.server.scripted_server").wait_ready()


@pytest.fixture(scope="module")
def server():
    s = scripted_server()
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


def test_claude_code_through_the_front_proxy_stays_on_the_box_its_session_id_picks(server, tmp_path):
    """nginx hashes Claude Code's X-Claude-Code-Session-Id header: both requests of a turn with a tool call reach the
    box its session id (``--session-id``) picks, one that a client without the header (keyed by its address) would not
    reach; the key passes through to the box, which checks it."""
    claude = cli("claude")
    other = scripted_server()
    servers = [server, other]
    boxes = [f"127.0.0.1:{s.port}" for s in servers]
    by_address = box_for_session("127.0.0.1", boxes)
    sessions = (str(uuid.uuid5(uuid.NAMESPACE_URL, f"glm53-claude-{k}")) for k in itertools.count())
    session = next(s for s in sessions if box_for_session(s, boxes) != by_address)
    home = box_for_session(session, boxes)
    front = FrontProxy(boxes, boxes[0], 2, dict(os.environ))  # no router here: what is not /v1/messages goes to a box
    try:
        deadline = time.monotonic() + 30
        while not front.answers() and time.monotonic() < deadline:
            time.sleep(0.1)
        home_dir = tmp_path / "home"
        home_dir.mkdir()
        env = {"HOME": str(home_dir), "ANTHROPIC_BASE_URL": front.url, "ANTHROPIC_API_KEY": KEY, "ANTHROPIC_MODEL": MODEL,
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
        before = [requests_logged(s, "/v1/messages") for s in servers]
        done = run([claude, "-p", "[[script:claude_bash]] print the number", "--allowedTools", "Bash", "--max-turns", "3",
                    "--session-id", session], env, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip() == AGENT_ANSWER + RAN
        served = [requests_logged(s, "/v1/messages") - b for s, b in zip(servers, before)]
        assert served == [2 if i == home else 0 for i in range(len(servers))]
    finally:
        front.stop()
        other.stop()


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
