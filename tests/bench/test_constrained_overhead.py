"""bench/constrained_overhead.py against the CPU demo model: the report's shape and its arithmetic."""

from __future__ import annotations

from .tools import run_tool


def test_the_overhead_report(demo_server, tmp_path):
    rc, result, log = run_tool("constrained_overhead.py", tmp_path / "overhead.json", "--url", demo_server.url, "--streams", "1", "2",
                               "--items", "3", "--repeats", "1", timeout=300)
    assert rc == 0, log
    assert [r["streams"] for r in result["results"]] == [1, 2] and result["server_info"]["loaded_model"]["name"] == "glm53-tiny"
    for r in result["results"]:
        # the free answers have the constrained one's length: the rates compare like with like
        assert len(r["answer_tokens"]) == 1 and r["answer_tokens"][0] > 3 * 4
        for kind in ("constrained", "free"):
            assert r[kind]["per_stream"] > 0 and r[kind]["aggregate"] > 0
        assert r["overhead_per_stream"] == round(1 - r["constrained"]["per_stream"] / r["free"]["per_stream"], 4)
