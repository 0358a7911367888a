"""bench/sweep.py against the CPU demo model: the fixed-length mode with /stats and /server_info; the original's
natural-length mode through a proxy that hides those two endpoints (as a server without them would); hit rates
from a proxy that answers /stats with known counters."""

from __future__ import annotations

import contextlib
import http.server
import itertools
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from tests.server.servers import REPO, Server, free_port

from .tools import run_tool

CTX = 2048
FIXED_TOKENS = 32
FIXED_CONTEXT = 300


@pytest.fixture(scope="module")
def server():
    s = Server(["serve", "--engine", "tiny", "-cs", str(CTX), "--max-batch-size", "4"]).wait_ready()
    yield s
    s.stop()


def sweep(server_url: str, tmp_path, *args: str):
    return run_tool("sweep.py", tmp_path / "sweep.json", "--url", server_url, "--seed", "7", *args)


def test_fixed_decode_sweep(server, tmp_path):
    rc, result, log = sweep(
        server.url, tmp_path, "--label", "ci", "--prefill", "256", str(CTX), "--reps", "2", "--conc", "1", "2",
        "--dec-reps", "1", "--prefix", "512", "--fixed-decode", str(FIXED_TOKENS), "--fixed-context", str(FIXED_CONTEXT),
    )
    assert rc == 0, log
    assert result["label"] == "ci" and result["ctx_len"] == CTX and result["params"]["decode_mode"] == "fixed"
    assert result["server_info"]["settings"]["cache_size"] == CTX and result["server_info"]["settings"]["engine"] == "tiny"
    assert result["params"]["id_range"] == [0, result["server_info"]["loaded_model"]["vocab_size"]]

    prefill = result["prefill"]["256"]
    assert prefill["n"] == 2 and len(prefill["all"]) == 2 and min(prefill["all"]) > 0
    assert prefill["min"] <= prefill["median"] <= prefill["max"] and prefill["cached_tokens"] == [0, 0]
    assert "skipped" in result["prefill"][str(CTX)]

    assert set(result["decode"]) == {"C1", "C2", "C1@512"}
    for name, streams, prompt_tokens in (("C1", 1, FIXED_CONTEXT), ("C2", 2, FIXED_CONTEXT), ("C1@512", 1, 512 + FIXED_CONTEXT)):
        level = result["decode"][name]
        (rnd,) = level["rounds"]
        assert rnd["tokens_per_stream"] == [FIXED_TOKENS] * streams and rnd["finish"] == ["length"] * streams
        assert rnd["prompt_tokens"] == [prompt_tokens] * streams
        assert level["aggregate"]["median"] > 0 and level["per_stream_mean"]["median"] > 0
        delta = result["stats"][name]["delta"]["scheduler"]
        assert (delta["prompt_tokens"], delta["completion_tokens"]) == (prompt_tokens * streams, FIXED_TOKENS * streams)
        assert result["stats"][name]["before"] and result["stats"][name]["after"]
        assert len(result["prompt_sha256"]["decode"][name]) == 64
    assert result["stats"]["prefill"]["delta"]["scheduler"]["prompt_tokens"] == 2 * 256
    assert result["nonce_prefix"] == f"{7:08x}"


class _Proxy(http.server.BaseHTTPRequestHandler):
    """Forwards to ``upstream``, except the paths in ``replaced``: None answers 404, a function its JSON.
    HTTP/1.0, so the body of a relayed stream ends when the connection closes."""

    upstream = ""
    replaced: dict = {}

    def do_GET(self):
        self._relay(None)

    def do_POST(self):
        self._relay(self.rfile.read(int(self.headers["Content-Length"])))

    def _relay(self, body: bytes | None):
        if self.path in self.replaced:
            self._answer(self.replaced[self.path])
            return
        req = urllib.request.Request(self.upstream + self.path, data=body, headers={"Content-Type": "application/json"})
        try:
            resp = urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as e:
            resp = e
        with resp:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
            self.end_headers()
            for line in resp:
                self.wfile.write(line)
                self.wfile.flush()

    def _answer(self, make_body):
        if make_body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(make_body()).encode())

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def proxy(upstream: str, replaced: dict):
    handler = type("Proxy", (_Proxy,), {"upstream": upstream, "replaced": replaced})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_natural_decode_on_a_server_without_stats_or_server_info(server, tmp_path):
    # no /server_info, so no vocabulary size: the ids must be given in the demo model's range
    with proxy(server.url, {"/stats": None, "/server_info": None}) as url:
        rc, result, log = sweep(url, tmp_path, "--prefill", "256", "--reps", "1", "--conc", "2", "--dec-reps", "1",
                                "--prefix", "--id-range", "0", "256")
    assert rc == 0, log
    assert result["server_info"] is None and result["stats"] is None
    assert result["ctx_len"] == CTX  # from /v1/models
    assert result["params"]["decode_mode"] == "natural" and result["prefill"]["256"]["n"] == 1
    (rnd,) = result["decode"]["C2"]["rounds"]
    assert rnd["max_new_tokens"] == (CTX - max(rnd["prompt_tokens"])) // 2 - 64
    assert all(0 < n <= rnd["max_new_tokens"] for n in rnd["tokens_per_stream"]) and sum(rnd["tokens_per_stream"]) == rnd["tokens"]
    assert set(rnd["finish"]) <= {"stop", "length"} and rnd["aggregate"] > 0


def test_hit_rates_are_derived_from_the_counters_of_each_phase(server, tmp_path):
    calls = itertools.count(1)

    def stats():  # each snapshot: 90 more hits and 10 more misses; the cumulative rate drifts
        k = next(calls)
        return {"expert_cache": [{"hits": 90 * k, "misses": 10 * k, "hit_rate": 0.5 + k / 100}],
                "cpu_tier": {"unique_hits": 3 * k, "unique_misses": k}, "mode": "fast"}

    with proxy(server.url, {"/stats": stats}) as url:
        rc, result, log = sweep(url, tmp_path, "--prefill", "256", "--reps", "1", "--conc", "1", "--dec-reps", "1",
                                "--prefix", "--fixed-decode", "4", "--fixed-context", "200")
    assert rc == 0, log
    assert set(result["stats"]) == {"prefill", "C1"}
    for phase in result["stats"].values():
        assert phase["delta"]["expert_cache"] == [{"hits": 90, "misses": 10, "hit_rate": 0.9}]
        assert phase["delta"]["cpu_tier"] == {"unique_hits": 3, "unique_misses": 1, "unique_hit_rate": 0.75}
        assert phase["after"]["expert_cache"][0]["hits"] == phase["before"]["expert_cache"][0]["hits"] + 90


def test_the_original_projects_command_line_is_accepted_as_written(tmp_path):
    """Its documented speed protocol, against a port nothing listens on: the arguments parse, the server is missing."""
    closed = free_port()
    proc = subprocess.run([sys.executable, "bench/sweep.py", "--url", f"http://127.0.0.1:{closed}",
                           "--card", "rtx-3090-24gb/glm-5.3-flash-offload", "--template", "glm", "--config", "0123abcd fast",
                           "--prefill", "8192", "32768", "--conc", "1", "2", "4", "--reps", "3", "--dec-reps", "2",
                           "--no-early-exit", "--out", str(tmp_path / "sweep.json")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unrecognized arguments" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: cannot reach http://127.0.0.1:{closed}/server_info")


def best_known(tmp_path, values: dict) -> str:
    path = tmp_path / "best_known.json"
    path.write_text(json.dumps({"my-card": values}))
    return str(path)


SHORT = ("--prefill", "256", "--reps", "1", "--conc", "1", "--dec-reps", "1", "--prefix", "--fixed-decode", "8", "--fixed-context", "200")


def test_card_config_and_template_are_recorded_and_gates_pass_against_a_modest_best(server, tmp_path):
    rc, result, log = sweep(server.url, tmp_path, "--card", "my-card", "--config", "abc fast", "--template", "glm",
                            "--best", best_known(tmp_path, {"prefill_256": 0.001, "decode_C1": 0.001}), *SHORT)
    assert rc == 0, log
    assert (result["card"], result["config"], result["status"]) == ("my-card", "abc fast", "DONE")
    assert result["template"] == {"name": "glm", "prompt": "[gMASK]<sop><|user|>{user}<|assistant|><think></think>"}
    assert result["best_known_before"] == {"prefill_256": 0.001, "decode_C1": 0.001}
    assert {k: (g["best_known"], g["pass"]) for k, g in result["gates"].items()} == {"prefill_256": (0.001, True), "decode_C1": (0.001, True)}
    assert result["gates"]["prefill_256"]["value"] == result["prefill"]["256"]["median"]


def test_a_run_below_the_best_known_exits_early_unless_told_not_to(server, tmp_path):
    best = best_known(tmp_path, {"prefill_256": 1e12})
    rc, result, log = sweep(server.url, tmp_path, "--card", "my-card", "--config", "c", "--best", best, *SHORT)
    assert rc == 3, log
    assert result["status"].startswith("EARLY_EXIT at prefill_256: ") and result["gates"]["prefill_256"]["pass"] is False
    assert result["prefill"]["256"]["n"] == 1 and result["decode"] == {}  # what ran before the exit is kept
    rc, result, log = sweep(server.url, tmp_path, "--card", "my-card", "--config", "c", "--best", best, "--no-early-exit", *SHORT)
    assert rc == 0, log
    assert result["status"] == "DONE" and result["gates"]["prefill_256"]["pass"] is False and result["decode"]["C1"]["rounds"]
