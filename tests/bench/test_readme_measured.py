"""bench/readme_measured.py: the README's Measured block from a fixture run, and its rewrite between markers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import readme_measured, scoreboard

FIXTURE = Path(__file__).parent / "fixtures" / "compare-results.json"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def results() -> dict:
    return scoreboard.finish(json.loads(FIXTURE.read_text()))


def test_block_content(results):
    block = readme_measured.measured_block(results, "2026-11-30-h200.json")
    assert "NVIDIA H200 (driver 580.159.04)" in block and "Intel(R) Xeon(R) Platinum 8480+ (16 cores, 16 CPUs), 134 GB RAM" in block
    assert "`bench/results/2026-11-30-h200.json`" in block
    assert "synthetic `scaled` (seed 1): 12 MoE layers x 288 experts, top-8, 36.1 GB" in block
    assert "keep 32 of 288 experts per layer in VRAM (stock: `-mcs 256`" in block
    assert "PCIe 55.0 GB/s pinned copy, 51.0 GB/s zero-copy read; DRAM 93.0 GB/s read (16 threads)" in block
    lines = block.splitlines()
    header = next(line for line in lines if line.startswith("| arm |"))
    assert header.split(" | ")[1:4] == ["decode tok/s", "prefill 512 tok/s", "prefill 4096 tok/s"]
    assert "| stock-mcs | 45.7 | 162 | 1143 | — | — | 31.0 | 7.6 | 1.00x | 69% |" in lines
    exact = next(line for line in lines if line.startswith("| exact |"))
    assert exact.split(" | ")[1:7] == ["55.0", "900", "4700", "42.0%", "47.0%", "33.0"]
    assert exact.endswith("| 1.20x | 83% |")
    assert any(line.startswith("| stock-vram (run 1) | 207.0 |") for line in lines)
    assert any(line.startswith("| stock-vram (run 2) | 203.0 |") for line in lines)
    assert any(line.startswith("| fast | not available: NotImplementedError: the CPU tier is not built yet |") for line in lines)
    assert "Exact-mode decode bound: **65.9 tok/s**" in block and "42.0% hit rate (exact arm, decode phase)" in block
    assert "Spread of stock-vram over 2 runs ((max - min) / mean): decode 2.0%" in block
    assert "exact decode / exact bound = 0.83 (target 0.85, not met)" in block
    assert "![decode and prefill tok/s per arm](bench/results/2026-11-30-h200.png)" in block
    assert "source .gpu/prep.sh && python3 -m bench.compare --out-dir $OUT" in block


def test_host_ram_is_set_against_the_routed_experts_and_preflights_estimate(results):
    assert "Host RSS peak" not in readme_measured.measured_block(results, "r.json")  # runs before the figures existed
    exact = next(a for a in results["arms"] if a["name"] == "exact")
    exact.update(host_rss_peak_gb=36.2, preflight_ram_gb=40.2)  # the checkpoint's 32.6 GB of routed experts
    block = readme_measured.measured_block(results, "r.json")
    assert "Host RSS peak: exact 36.2 GB = 1.11x its 32.6 GB of routed experts, 0.90x preflight's 40.2 GB." in block


def test_rewrite_between_markers_is_idempotent(results):
    readme = f"# x\n\n## Measured\n\n{readme_measured.BEGIN}\nold\n{readme_measured.END}\n\n## Development\n\nmore\n"
    block = readme_measured.measured_block(results, "r.json")
    new = readme_measured.rewrite(readme, block)
    assert "old" not in new and new.count(block) == 1 and new.endswith("## Development\n\nmore\n")
    assert readme_measured.rewrite(new, block) == new


def test_rewrite_adds_the_section_before_development():
    new = readme_measured.rewrite("# x\n\ntext\n\n## Development\n\nmore\n", "BLOCK")
    assert new == f"# x\n\ntext\n\n## Measured\n\n{readme_measured.BEGIN}\nBLOCK\n{readme_measured.END}\n\n## Development\n\nmore\n"
    assert readme_measured.rewrite("# x\n", "B").endswith(f"## Measured\n\n{readme_measured.BEGIN}\nB\n{readme_measured.END}\n")


def test_latest_results_and_the_command(results, tmp_path):
    older = dict(results, date="2026-11-01T00:00:00+00:00")
    (tmp_path / "a.json").write_text(json.dumps(results))
    (tmp_path / "b.json").write_text(json.dumps(older))
    (tmp_path / "c.json").write_text(json.dumps({"something": "else"}))
    (tmp_path / "d.json").write_text("[1, 2]")
    side = dict(results, date="2026-12-01T00:00:00+00:00", arms=[a for a in results["arms"] if a["name"] != "stock-vram"])
    (tmp_path / "e.json").write_text(json.dumps(side))  # later, but a side run without stock-vram: no ratios
    fewer = dict(results, date="2026-12-02T00:00:00+00:00", arms=[a for a in results["arms"] if a["name"] != "stock-mcs"])
    (tmp_path / "f.json").write_text(json.dumps(fewer))  # later, but not every arm ran
    assert readme_measured.latest_results(tmp_path).name == "a.json"
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Development\n")
    assert readme_measured.main(["--results", str(tmp_path / "a.json"), "--readme", str(readme), "--check"]) == 1
    assert readme_measured.main(["--results", str(tmp_path / "a.json"), "--readme", str(readme)]) == 0
    assert readme_measured.main(["--results", str(tmp_path / "a.json"), "--readme", str(readme), "--check"]) == 0
    assert "| exact | 55.0 |" in readme.read_text()
    with pytest.raises(FileNotFoundError):
        readme_measured.latest_results(tmp_path / "nothing")


def test_the_readme_has_the_markers():
    text = (REPO / "README.md").read_text()
    assert text.index(readme_measured.BEGIN) < text.index(readme_measured.END)


def test_the_fast_mode_block_lists_every_emulated_run_the_quality_and_the_projections(tmp_path):
    base = json.loads((Path(__file__).parent / "fixtures" / "compare-results.json").read_text())
    for rate, fast in ((25.0, 50.0), (12.5, 30.0)):
        doc = {**base, "link_emulation": {"target_gbs": rate}, "arms": [dict(a) for a in base["arms"]]}
        arm = next(a for a in doc["arms"] if a["name"] == "fast")
        arm.update(status="ok", decode_tok_s=fast, decode_runs=[fast])
        (tmp_path / f"run-{rate}.json").write_text(json.dumps(doc))
    (tmp_path / "x-decode-kl-floor.json").write_text(json.dumps({"kl_mean": 0.1}))
    (tmp_path / "x-decode-kl-fast-int16.json").write_text(json.dumps({"kl_mean": 0.04}))
    block = readme_measured.fast_block(tmp_path)
    rows = [line for line in block.splitlines() if line.startswith("| 1") or line.startswith("| 2")]
    assert rows[0].startswith("| 12.5 GB/s | 55.0 | 30.0 | 0.55x") and rows[1].startswith("| 25 GB/s | 55.0 | 50.0 | 0.91x")
    assert "45.7 (stock-mcs)" in rows[1]
    assert "paired decode KL 0.0400 against a noise floor of 0.1000" in block and "0.40x the floor" in block
    assert "not measurements" in block and "| `anchor-3090-epyc7443p` |" in block and "fast_tok_s 28.15" in block
    readme = f"a\n{readme_measured.FAST_BEGIN}\nold\n{readme_measured.FAST_END}\nb\n"
    assert readme_measured.rewrite_fast(readme, "new") == f"a\n{readme_measured.FAST_BEGIN}\nnew\n{readme_measured.FAST_END}\nb\n"


def test_the_readme_holds_the_generated_fast_mode_block():
    text = (REPO / "README.md").read_text()
    assert readme_measured.FAST_BEGIN in text and readme_measured.FAST_END in text
    current = text.partition(readme_measured.FAST_BEGIN)[2].partition(readme_measured.FAST_END)[0].strip()
    assert current == readme_measured.fast_block().strip()  # `python3 -m bench.readme_measured` rewrites it


def test_the_ram_tier_block_is_the_latest_reports_table_and_goals(tmp_path):
    assert "No RAM-tier run recorded yet" in readme_measured.ram_block(tmp_path)
    row = {"decode_tok_s": 8.5, "bound_tok_s": 9.9, "of_bound": 0.86, "disk_reads_per_token": 13.3, "w_disk_gbs": 1.39,
           "prefill_tok_s": 249.0, "prefill_of_bound": 0.623, "host_rss_peak_gb": 19.6}
    doc = {"schema": readme_measured.RAM_SCHEMA, "date": "2026-12-02T07:00:00", "machine": {"gpu": "NVIDIA H200"},
           "checkpoint": {"preset": "scaled"}, "t_fix_ms": 5.8, "w_link_gbs": 50.2,
           "by_ram_share": {"50": row, "25": {"status": "not run or failed"}},
           "goals": {"decode_50_of_bound": {"value": 0.86, "target": 0.85, "met": True}}}
    (tmp_path / "2026-12-01-ram-tier.json").write_text(json.dumps({**doc, "date": "2026-12-01T07:00:00", "by_ram_share": {}}))
    (tmp_path / "2026-12-02-ram-tier.json").write_text(json.dumps(doc))
    block = readme_measured.ram_block(tmp_path)
    assert "`bench/results/2026-12-02-ram-tier.json`" in block and "| 50 % | 8.50 | 9.90 | 0.860 | 13.3 | 1.39 | 249 | 0.62 | 19.6 | this one |" in block
    assert "| 25 % | not run or failed |" in block and "decode_50_of_bound 0.86 (target 0.85, met)" in block
    # a later report of some shares only: the others come from the newest report that ran them, named
    later = {**doc, "date": "2026-12-03T07:00:00", "t_fix_ms": None,
             "by_ram_share": {"25": {**row, "decode_tok_s": 3.6}, "100": {"status": "not run or failed"}}}
    (tmp_path / "2026-12-03-ram-tier.json").write_text(json.dumps(later))
    block = readme_measured.ram_block(tmp_path)
    assert "`bench/results/2026-12-03-ram-tier.json`" in block and "T_fix (no 100 % run in this report)" in block
    assert "| 50 % | 8.50 | 9.90 | 0.860 | 13.3 | 1.39 | 249 | 0.62 | 19.6 | `2026-12-02-ram-tier.json` |" in block
    assert "| 25 % | 3.60 |" in block and block.index("| 100 % | not run or failed |") < block.index("| 50 %")


def test_the_readme_holds_the_generated_ram_tier_block():
    text = (REPO / "README.md").read_text()
    current = text.partition(readme_measured.RAM_BEGIN)[2].partition(readme_measured.RAM_END)[0].strip()
    assert current == readme_measured.ram_block().strip()  # `python3 -m bench.readme_measured` rewrites it
