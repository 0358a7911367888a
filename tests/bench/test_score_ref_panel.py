"""bench/score_ref_panel.py against the CPU demo model, with a panel made by that same server: the scorer must
find perfect agreement there, and count (never crash on) disagreement and ids the server's answer lacks."""

from __future__ import annotations

import copy
import json
import math

import pytest

from tests.server.servers import Server

from .tools import run_tool

PROMPTS = ("Name three rivers of Europe.", "Why is the sky blue?", "Count from one to ten.")
COMPLETION_TOKENS = 16


@pytest.fixture(scope="module")
def server():
    s = Server(["serve", "--engine", "tiny", "-cs", "1024"]).wait_ready()
    yield s
    s.stop()


def greedy_item(server: Server, prompt: str) -> dict:
    """One panel item from the server's own greedy completion and its top-20 at every step."""
    status, tok = server.post("/tokenize", {"text": f"[gMASK]<sop><|user|>{prompt}<|assistant|><think></think>"})
    assert status == 200, tok
    ids = tok["tokens"]
    status, out = server.post("/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": COMPLETION_TOKENS, "temperature": 0, "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 20,
    })
    assert status == 200, out
    tops = out["meta_info"]["output_top_logprobs"]
    return {"prompt": prompt, "prompt_len": len(ids), "tokens": ids + out["output_ids"], "completion": out["text"],
            "top20_ids": [[e[1] for e in top] for top in tops], "top20_lp": [[e[0] for e in top] for top in tops]}


@pytest.fixture(scope="module")
def panel(server) -> list[dict]:
    items = [greedy_item(server, p) for p in PROMPTS]
    # the last item keeps the distribution after its final token: that position is scored from the output
    items[-1]["tokens"] = items[-1]["tokens"][:-1]
    return items


@pytest.fixture(scope="module")
def vocab_size(server) -> int:
    return server.get("/server_info")[1]["loaded_model"]["vocab_size"]


def score(server, tmp_path, panel, *args):
    path = tmp_path / "panel.json"
    path.write_text(json.dumps(panel))
    return run_tool("score_ref_panel.py", tmp_path / "score.json", "--url", server.url, "--panel", str(path), *args)


def test_a_panel_of_the_server_itself_agrees_exactly(server, tmp_path, panel):
    rc, result, log = score(server, tmp_path, panel, "--min-top1", "1.0", "--max-kl", "1e-6")
    assert rc == 0, log
    assert result["positions"] == 3 * COMPLETION_TOKENS
    assert result["top1_agreement"] == 1.0 and result["greedy_match"] == 1.0
    assert result["mean_kl_top20"] < 1e-6 and result["p99_kl"] < 1e-6
    assert result["missing_ids"] == 0 and result["outside_topk"] == 0
    assert [p["positions"] for p in result["per_prompt"]] == [COMPLETION_TOKENS] * 3
    assert all(p["first_disagreement"] is None for p in result["per_prompt"])
    assert result["gates"]["min_top1"]["pass"] and result["gates"]["max_kl"]["pass"] and result["passed"]
    assert result["server_info"]["settings"]["engine"] == "tiny" and result["server_info"]["settings"]["cache_size"] == 1024
    assert result["panel"]["items"] == 3 and len(result["panel"]["sha256"]) == 64


def perturb(panel: list[dict], vocab_size: int) -> list[dict]:
    """Item 0, position 0: the reference's ids rotated (its favourite is now another token); item 1, position 2:
    an id outside the vocabulary; item 2, position 1: an id the server does not rank in its top-20."""
    bad = copy.deepcopy(panel)
    ids = bad[0]["top20_ids"][0]
    bad[0]["top20_ids"][0] = ids[1:] + ids[:1]
    bad[1]["top20_ids"][2][-1] = vocab_size + 1000
    ranked = set(bad[2]["top20_ids"][1])
    bad[2]["top20_ids"][1][-1] = next(t for t in range(vocab_size) if t not in ranked)
    return bad


def kl_with_last_at_floor(lps: list[float]) -> float:
    ref = [math.exp(x) for x in lps]
    server = ref[:-1] + [1e-30]
    ref_sum, server_sum = sum(ref), sum(server)
    return sum(r / ref_sum * math.log((r / ref_sum) / (s / server_sum)) for r, s in zip(ref, server))


def test_disagreement_and_missing_ids_are_counted(server, tmp_path, panel, vocab_size):
    rc, result, log = score(server, tmp_path, perturb(panel, vocab_size))
    assert rc == 0, log
    n = 3 * COMPLETION_TOKENS
    assert result["top1_agreement"] == round((n - 1) / n, 6)
    first, second, third = result["per_prompt"]
    assert first["first_disagreement"] == 0 and first["top1"] < 1.0 and first["kl"] > 0.01
    assert (first["missing_ids"], second["missing_ids"], third["missing_ids"]) == (0, 1, 0)
    assert (first["outside_topk"], second["outside_topk"], third["outside_topk"]) == (0, 1, 1)
    assert result["missing_ids"] == 1 and result["outside_topk"] == 2
    # the missing id is charged at the floor (1e-30); every other position of that prompt agrees exactly
    assert second["kl"] * COMPLETION_TOKENS == pytest.approx(kl_with_last_at_floor(panel[1]["top20_lp"][2]), rel=1e-5)
    assert third["top1"] == 1.0 and third["kl"] > 0

    rc, result, _ = score(server, tmp_path, perturb(panel, vocab_size), "--min-top1", "1.0")
    assert rc == 1 and result["gates"]["min_top1"] == {"limit": 1.0, "value": round((n - 1) / n, 6), "pass": False}


def test_without_requested_ids_everything_outside_the_top_k_is_missing(server, tmp_path, panel, vocab_size):
    rc, result, log = score(server, tmp_path, perturb(panel, vocab_size), "--topk-only")
    assert rc == 0, log
    assert result["topk_only"] and result["missing_ids"] == result["outside_topk"] == 2


def test_a_malformed_panel_is_refused_naming_the_item(server, tmp_path, panel):
    bad = copy.deepcopy(panel)
    bad[1]["top20_lp"][3] = bad[1]["top20_lp"][3][:5]
    rc, result, log = score(server, tmp_path, bad)
    assert rc == 2 and result is None
    assert "item 1" in log and "top20_lp" in log
