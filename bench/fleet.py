"""A fleet on loopback: N ``glm53 serve`` replicas behind SGLang's router (``sglang-router``), sharing one Redis or
Valkey for the Responses store, with nginx in front (``front_url``) for the Anthropic Messages API. The fleet tests
(``tests/server/test_fleet.py``) and the router benchmark (``bench/fleet_router.py``) start it; the NixOS fleet
module and ``nix/compose/fleet.yaml`` deploy the same shape.

Each replica runs in a process group of its own, so ``kill`` takes the gunicorn master and its worker down at once
(a crash: SIGKILL), and ``drain`` sends SIGTERM as a service manager's stop does (in-flight requests finish, new
ones get 503, then it exits).

The router's flags are ``router_flags``: cache-aware routing over a prefix tree of the requests' text; health checks
every ``health_s`` on ``/health``, one failure taking a replica out of rotation and one success putting it back; a
circuit breaker that opens on the first failed request, so a replica that died between two health checks costs at
most the request that found it (that request is retried on another replica, as 5xx answers are); retries on 408,
429 and 5xx, which is how a draining replica's 503 reaches another replica instead of the client.

The front proxy's configuration is ``nix/lib/front-proxy.conf`` (its comments say why each setting), filled in by
``front_proxy_conf``: ``/v1/messages`` goes to the replicas by a consistent hash of Claude Code's session header,
everything else to the router. ``box_for_session`` computes which replica that hash picks.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "glm-5.3-flash"
FRONT_PROXY_TEMPLATE = REPO / "nix" / "lib" / "front-proxy.conf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_flags(worker_urls: list[str], port: int, metrics_port: int, health_s: int, host: str = "127.0.0.1") -> list[str]:
    """The router's command-line flags for a fleet (see the module docstring for why each)."""
    return [
        "--host", host, "--port", str(port), "--worker-urls", *worker_urls,
        "--policy", "cache_aware",
        "--health-check-endpoint", "/health", "--health-check-interval-secs", str(health_s),
        "--health-failure-threshold", "1", "--health-success-threshold", "1",
        "--cb-failure-threshold", "1", "--cb-success-threshold", "1", "--cb-timeout-duration-secs", str(health_s),
        "--retry-max-retries", "5",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", "warn",
    ]


def front_proxy_conf(boxes: list[str], router: str, listen: str, runtime_dir: str, health_s: int) -> str:
    """nginx's configuration for the front proxy: ``boxes`` and ``router`` as ``host:port``, ``listen`` the listen
    directive's arguments; a box that fails one attempt is left out for ``health_s``."""
    values = {
        "@LISTEN@": f"listen {listen};",
        "@BOXES@": " ".join(f"server {box} max_fails=1 fail_timeout={health_s}s;" for box in boxes),
        "@ROUTER@": router,
        "@RUNTIME@": runtime_dir,
    }
    text = FRONT_PROXY_TEMPLATE.read_text()
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text


def box_for_session(session_id: str, boxes: list[str]) -> int:
    """The index of the box that nginx's ``hash ... consistent`` sends ``session_id`` to while all are up.

    nginx's ring (ngx_http_upstream_hash_module, compatible with Cache::Memcached::Fast): 160 points per server,
    the first the CRC-32 of ``host NUL port`` plus four zero bytes, each next one of the same with the previous
    point's value (little-endian) in their place; points sorted, a repeated value kept once; a key goes to the first
    point at or above its CRC-32, past the last to the first."""
    ring: dict[int, int] = {}
    for index, box in enumerate(boxes):
        host, port = box.rsplit(":", 1)
        seed, point = zlib.crc32(f"{host}\0{port}".encode()), 0
        for _ in range(160):
            point = zlib.crc32(point.to_bytes(4, "little"), seed)
            ring.setdefault(point, index)
    values = sorted(ring)
    key = zlib.crc32(session_id.encode())
    at = bisect.bisect_left(values, key)
    return ring[values[at % len(values)]]


def get_json(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


class Process:
    """A child in its own process group, logging to a temporary file."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        # a file, not a pipe: a pipe nobody reads fills up and blocks the child; closed with the object
        self.log_file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def log(self) -> str:
        self.log_file.seek(0)
        return self.log_file.read()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()


class FrontProxy:
    """nginx with the front proxy's configuration on a free loopback port, in front of ``boxes`` (``host:port``) for
    ``/v1/messages`` and ``router`` for the rest."""

    def __init__(self, boxes: list[str], router: str, health_s: int, env: dict[str, str]):
        nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
        if nginx is None:
            raise RuntimeError("the fleet's front proxy needs nginx (Debian: apt-get install nginx)")
        self.dir = tempfile.TemporaryDirectory(prefix="glm53-front-")
        # run as root (a CI container), the master hands the requests to unprivileged workers, which must get in
        os.chmod(self.dir.name, 0o755)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = Path(self.dir.name) / "nginx.conf"
        conf.write_text(front_proxy_conf(boxes, router, f"127.0.0.1:{self.port}", self.dir.name, health_s))
        self.process = Process([nginx, "-e", "stderr", "-c", str(conf)], env)

    def answers(self) -> bool:
        """Whether nginx takes connections (any answer, an upstream's error included)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        self.process.signal(signal.SIGTERM)
        self.process.wait(30)
        self.dir.cleanup()


class Fleet:
    def __init__(self, replicas: int = 3, replica_args: tuple[str, ...] = (), health_s: int = 1, env: dict | None = None):
        self.ports = [free_port() for _ in range(replicas)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.replica_args = ("--engine", "tiny", "--max-batch-size", "4", "-cs", "4096", *replica_args)
        self.health_s = health_s
        self.store_port = free_port()
        self.router_port = free_port()
        self.url = f"http://127.0.0.1:{self.router_port}"
        self.front_url = ""
        clean = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
        clean["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        clean["GLM53_RESPONSES_STORE_URL"] = f"redis://127.0.0.1:{self.store_port}/0"
        self.env = {**clean, **(env or {})}
        self.replicas: list[Process | None] = [None] * replicas
        self.store: Process | None = None
        self.router: Process | None = None
        self.front: FrontProxy | None = None

    # ----- lifecycle

    def start(self) -> Fleet:
        redis = shutil.which("valkey-server") or shutil.which("redis-server")
        if redis is None:
            raise RuntimeError("the fleet's Responses store needs valkey-server or redis-server (Debian: apt-get install redis-server)")
        self.store = Process([redis, "--bind", "127.0.0.1", "--port", str(self.store_port), "--save", "", "--appendonly", "no"], self.env)
        for i in range(len(self.ports)):
            self.start_replica(i)
        for i in range(len(self.ports)):
            self.wait_healthy(i)
        router = [sys.executable, "-m", "sglang_router.launch_router",
                  *router_flags(self.urls, self.router_port, free_port(), self.health_s)]
        self.router = Process(router, self.env)
        self.wait_until(lambda: all(self.routed()), "the router to take every replica", 60)
        self.front = FrontProxy([url.removeprefix("http://") for url in self.urls], f"127.0.0.1:{self.router_port}",
                                self.health_s, self.env)
        self.front_url = self.front.url
        self.wait_until(self.front.answers, "the front proxy", 30)
        return self

    def start_replica(self, i: int) -> None:
        argv = [sys.executable, "-m", "glm53", "serve", *self.replica_args, "--port", str(self.ports[i])]
        self.replicas[i] = Process(argv, self.env)

    def kill(self, i: int) -> None:
        """A crash: the replica's master and worker get SIGKILL at once."""
        self.replicas[i].signal(signal.SIGKILL)
        self.replicas[i].wait(10)

    def drain(self, i: int, timeout: float = 60) -> None:
        """A service manager's stop: SIGTERM, then wait for the replica to finish its requests and exit."""
        self.replicas[i].signal(signal.SIGTERM)
        self.replicas[i].wait(timeout)

    def stop(self) -> None:
        if self.front is not None:
            self.front.stop()
        for p in [self.router, *self.replicas, self.store]:
            if p is not None:
                p.signal(signal.SIGTERM)
        for p in [self.router, *self.replicas, self.store]:
            if p is not None:
                p.wait(30)

    def __enter__(self) -> Fleet:  # noqa: PYI034 (Fleet is final)
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- state

    def wait_until(self, condition, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for p in (self.store, self.router, self.front.process if self.front else None):
                if p is not None and p.proc.poll() is not None:
                    raise RuntimeError(f"exited while waiting for {what}:\n{p.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def wait_healthy(self, i: int, timeout: float = 90) -> None:
        def healthy() -> bool:
            if self.replicas[i].proc.poll() is not None:
                raise RuntimeError(f"replica {i} exited:\n{self.replicas[i].log()[-3000:]}")
            try:
                return get_json(self.urls[i] + "/health", 1).get("status") == "ok"
            except OSError:
                return False
        self.wait_until(healthy, f"replica {i}", timeout)

    def routed(self) -> list[bool]:
        """For each replica, whether the router now sends it work (registered and healthy)."""
        try:
            workers = {w["url"]: w["is_healthy"] for w in get_json(self.url + "/workers")["workers"]}
        except OSError:
            return [False] * len(self.urls)
        return [workers.get(url, False) for url in self.urls]

    def served(self, endpoint: str) -> list[int]:
        """Per replica, the 200 answers it gave on ``endpoint`` so far (0 for one that is down)."""
        out = []
        for url in self.urls:
            try:
                out.append(get_json(url + "/stats")["requests"]["requests"].get(f"{endpoint} 200", 0))
            except OSError:
                out.append(0)
        return out

    def active(self) -> list[int]:
        """Per replica, the generation jobs it is running now."""
        return [get_json(url + "/stats")["scheduler"]["active"] for url in self.urls]
