"""The device-side quality tools on the tiny checkpoint: `glm53 panel` (stock exllamav3), and bench/decode_kl.py's
paths (a path against itself gives KL 0; an injected perturbation gives a small positive KL; the cache-driven
decode path agrees with exllamav3's own generator)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_panel_of_the_tiny_checkpoint(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Why is the sky blue?", "Write a haiku about rain."]))
    out = tmp_path / "panel.json"
    subprocess.run([sys.executable, "-m", "glm53", "panel", "-m", str(tiny_checkpoint), "--out", str(out),
                    "--prompts", str(prompts), "--max-new", "24"], cwd=REPO, check=True, timeout=600)
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from score_ref_panel import load_panel
    finally:
        sys.path.remove(str(REPO / "bench"))
    items = load_panel(str(out))
    assert [i["prompt"] for i in items] == json.loads(prompts.read_text())
    meta = json.loads(out.with_name("panel.meta.json").read_text())
    assert meta["exllamav3"] == "1.6.5" and meta["prompts"] == 2 and meta["checkpoint"]["config_sha256"]
    for item, p in zip(items, meta["per_prompt"]):
        assert len(item["top20_ids"]) == len(item["tokens"]) - item["prompt_len"] + 1 == p["positions"]
        # the teacher-forced forward (prefill kernels) and the greedy decode (decode kernels) round differently;
        # on this random model near-ties flip a few of 24 argmaxes (3 seen on the H200), never most of them
        assert p["argmax_mismatches"] <= p["completion_len"] // 2


@pytest.fixture(scope="module")
def stock(tiny_checkpoint):
    from glm53.engine.exl3.stock import load_stock

    s = load_stock(tiny_checkpoint, cache_tokens=1024, caches=2)
    yield s
    s.close()


PROMPT = [154822, 154824, 154827] + list(range(300, 340)) + [154828, 154841, 154842]


def test_a_path_against_itself_has_zero_kl(stock):
    from bench import decode_kl

    a = decode_kl.make_path("stock", stock.model, stock.caches[0], stock.vocab_size)
    b = decode_kl.make_path("stock", stock.model, stock.caches[1], stock.vocab_size)
    record = decode_kl.paired_decode(a, b, PROMPT, 48)
    assert all(record.agree) and max(record.kls) == 0.0


def test_a_perturbation_gives_a_small_kl(stock):
    from bench import decode_kl

    a = decode_kl.make_path("stock", stock.model, stock.caches[0], stock.vocab_size)
    b = decode_kl.make_path("perturbed:0.01", stock.model, stock.caches[1], stock.vocab_size)
    record = decode_kl.paired_decode(a, b, PROMPT, 48)
    assert 0.0 < sum(record.kls) / len(record.kls) < 0.5
    again = decode_kl.paired_decode(a, b, PROMPT, 48)  # reseeded on reset: the same numbers
    assert again.kls == record.kls


def test_the_decode_path_follows_the_generator(stock):
    """ModelPath (rectangular-batch forwards, one token per step) teacher-forced on exllamav3's generator's greedy
    tokens: it picks the same token, or at a near-tie (the two round differently) has it second."""
    from bench import decode_kl
    from glm53.tools.panel import greedy

    generator = stock.generator(cache_index=1)
    try:
        reference = greedy(generator, PROMPT, 32, [])
    finally:
        generator.close()
    path = decode_kl.make_path("stock", stock.model, stock.caches[0], stock.vocab_size)
    path.reset()
    logits, ranks = path.logits(PROMPT), []
    for token in reference:
        ranks.append(int((logits > logits[token]).sum()))  # 0: the path's argmax too
        logits = path.logits([token])
    path.reset()
    assert len(reference) == 32 and max(ranks) <= 1 and ranks.count(0) >= 28, ranks


def test_prefetch_decode_gives_the_same_tokens_and_the_oracle_serves_every_miss(tiny_checkpoint, tmp_path):
    """bench/prefetch_decode.py on the tiny checkpoint with no cache and a pool wider than a token's picks: every run
    decodes the same tokens; the oracle serves every missed pick of every layer, the first one's by the lead (at the
    step's start), and without the lead every layer but the first (nothing comes before it in a step)."""
    out = tmp_path / "prefetch.json"
    subprocess.run([sys.executable, "-m", "bench.prefetch_decode", "-m", str(tiny_checkpoint), "--tokens", "12",
                    "--prompt-tokens", "16", "--engine-args", "--ec-cache-experts 0 --prefetch-slots 16", "--out", str(out)],
                   cwd=REPO, check=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["same_tokens"]
    assert set(result["runs"]) == {"off", "router", "oracle", "router-no-lead", "oracle-no-lead"}
    assert [name for name, r in result["runs"].items() if r["lead"]] == ["router", "oracle"]
    oracle, no_lead = result["runs"]["oracle"]["layers"], result["runs"]["oracle-no-lead"]["layers"]
    assert all(layer["recall"] == 1.0 and layer["prefetch_wasted"] == 0 for layer in oracle), oracle
    assert all(layer["recall"] == 1.0 and layer["prefetch_wasted"] == 0 for layer in no_lead[1:]), no_lead
    assert no_lead[0]["prefetch_copied"] == 0 and result["runs"]["off"]["prefetch_copied"] == 0


def test_fast_ablation_runs_every_arm_and_the_inert_tier_decodes_as_exact_mode(tiny_checkpoint, tmp_path):
    """bench/fast_ablation.py on the tiny checkpoint, the tier forced on: every run reports its rate and step hooks'
    host time, and the paused tier (every expert on the GPU) decodes exact mode's tokens."""
    out = tmp_path / "ablation.json"
    subprocess.run([sys.executable, "-m", "bench.fast_ablation", "-m", str(tiny_checkpoint), "--tokens", "12",
                    "--prompt-tokens", "16", "--engine-args", "--ec-cache-experts 0 --ct-enable 1", "--out", str(out)],
                   cwd=REPO, check=True, timeout=600)
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"exact", "exact-one-thread", "exact-one-cpu", "tier", "no-rest", "gpu-worth", "no-probes", "no-refresh", "inert"}
    assert result["runs"]["exact-one-thread"]["torch_threads"] == 1 and result["same_tokens_as_exact"]["exact-one-thread"]
    assert result["same_tokens_as_exact"]["inert"], result["same_tokens_as_exact"]
    assert all(r["decode_tok_s"] > 0 and r["after_step_us"]["mean"] is not None for r in result["runs"].values())


def test_moe_profile_times_the_layers_and_the_windows_between_them(tiny_checkpoint, tmp_path):
    """bench/moe_profile.py on the tiny checkpoint (the tier forced on for its hooks): both modes report a step, the
    MoE time within it, and the link-idle windows between the layers, before the first and after the last."""
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, "-m", "bench.moe_profile", "-m", str(tiny_checkpoint), "--tokens", "8",
                    "--prompt-tokens", "16", "--engine-args", "--ec-cache-experts 0 --ct-enable 1", "--out", str(out)],
                   cwd=REPO, check=True, timeout=600)
    for mode in json.loads(out.read_text())["modes"].values():
        w = mode["windows"]
        assert mode["step_us"] > 0 and mode["moe_us"] > 0 and w["lead_us"] > 0 and w["tail_us"] > 0
        assert 0 < w["gap_us"] < mode["step_us"]
