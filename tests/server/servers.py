"""Start real servers (gunicorn + one gevent worker) on loopback ports for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, argv: list[str], env: dict[str, str] | None = None, module: str = "glm53"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
        clean.update(env or {})
        clean["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", module, *argv, "--port", str(self.port)]
        # a file, not a pipe: a pipe nobody reads fills up and blocks the server's logging; kept where
        # SERVER_LOG_DIR says (the GPU runner collects them into its report)
        log_dir = os.environ.get("SERVER_LOG_DIR")
        self._log = open(Path(log_dir) / f"server-{self.port}.log", "w+") if log_dir else tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=clean, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, text=True)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def wait_ready(self, timeout: float = 60.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not become ready:\n" + self.log())

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict | str]:
        return self._request(urllib.request.Request(self.url + path, headers=headers or {}), timeout=30)

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict | str]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
        return self._request(req, timeout=60)

    @staticmethod
    def _request(req: urllib.request.Request, timeout: float) -> tuple[int, dict | str]:
        """(status, body as JSON when it parses, else text); error statuses are answers, not exceptions."""
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                text, status = r.read().decode(), r.status
        except urllib.error.HTTPError as e:
            text, status = e.read().decode(), e.code
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.log()


@contextmanager
def openai_client(server: Server) -> Iterator:
    """The official ``openai`` client on ``server``'s ``/v1``, no retries; closed on the way out, since idle keep-alive
    connections would hold the server's graceful shutdown."""
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client
