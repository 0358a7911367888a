"""bench/chart.py: what the chart draws (always) and the PNG itself (where matplotlib is installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import chart, scoreboard

FIXTURE = Path(__file__).parent / "fixtures" / "compare-results.json"


@pytest.fixture
def results() -> dict:
    return scoreboard.finish(json.loads(FIXTURE.read_text()))


def test_series(results):
    s = chart.series(results)
    assert [a["name"] for a in s["arms"]] == ["stock-vram", "stock-mcs", "stock-mcs-pa", "exact", "fast"]
    vram = s["arms"][0]
    assert vram["decode"] == 205.0 and vram["decode_range"] == (203.0, 207.0) and vram["prefill"][4096] == 6470.0
    assert s["arms"][4] == {"name": "fast", "status": "not available", "decode": None, "decode_range": None,
                            "prefill": {512: None, 4096: None}}
    assert [label for label, _ in s["bounds"]] == ["exact bound (42% hits)", "fast upper bound (CPU at DRAM rate)"]
    assert s["bounds"][0][1] == pytest.approx(results["bounds"]["exact"]["tok_s"])


def test_png_from_the_results(results, tmp_path):
    pytest.importorskip("matplotlib")
    out = chart.render(results, tmp_path / "chart.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_png_without_bounds_or_successful_arms(results, tmp_path):
    pytest.importorskip("matplotlib")
    for arm in results["arms"]:
        arm.update(status="error", error_tail="boom")
    results["bounds"] = scoreboard.bounds(results)
    assert chart.series(results)["bounds"] == []
    assert chart.render(results, tmp_path / "empty.png").is_file()
