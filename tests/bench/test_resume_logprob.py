"""bench/resume_logprob.py against the CPU demo model: every seed's resumed request takes its whole prompt from the
demo's prefix cache and agrees with the cache-less scoring to the bit (a position's keys and values depend on the
tokens before it alone), so the report's median is 0 and every greedy token is the scoring's own (the GPU engine's
resumed requests are what the tool is for)."""

from __future__ import annotations

from .tools import run_tool


def test_a_run_reports_every_seed_and_the_median(demo_server, tmp_path):
    rc, result, log = run_tool("resume_logprob.py", tmp_path / "resume.json", "--url", demo_server.url, "--seeds", "3",
                               "--prompt", "120", "--more", "40")
    assert rc == 0 and result is not None, log
    assert [row["seed"] for row in result["rows"]] == [1, 2, 3]
    assert all(row["cached"] == 120 and row["difference"] == 0.0 and row["same_greedy_token"] for row in result["rows"])
    assert result["median_difference"] == 0.0 and result["same_greedy_token"] == 3
    assert result["args"]["prompt"] == 120 and "api_key" not in result["args"]


def test_against_compares_two_runs_head_to_head_and_refuses_other_sizes(demo_server, tmp_path):
    first = tmp_path / "a.json"
    rc, a, log = run_tool("resume_logprob.py", first, "--url", demo_server.url, "--seeds", "2", "--prompt", "80", "--more", "20",
                          "--top", "5")
    assert rc == 0 and all(len(row["resumed_top"]) == 5 for row in a["rows"]), log
    rc, b, log = run_tool("resume_logprob.py", tmp_path / "b.json", "--url", demo_server.url, "--seeds", "2", "--prompt", "80",
                          "--more", "20", "--top", "5", "--against", str(first))
    assert rc == 0, log
    vs = b["against"]  # the same demo model twice: the same distributions
    assert vs["seeds"] == 2 and vs["same_greedy_token"] == 2 and vs["median_mean_abs_difference"] == 0.0
    assert all(row["common_top"] == 5 for row in vs["rows"])
    rc, _, log = run_tool("resume_logprob.py", tmp_path / "c.json", "--url", demo_server.url, "--seeds", "2", "--prompt", "90",
                          "--more", "20", "--against", str(first))
    assert rc == 2 and "was run with --prompt/--more 80/20, not 90/20" in log
