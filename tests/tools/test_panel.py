"""glm53 panel on the CPU: prompts, the thinking-off rendering through a synthetic checkpoint's tokenizer and chat
template, panel items from given logits (accepted by bench/score_ref_panel.py, and scoring themselves perfectly),
the sidecar facts and the command line. The GPU part (stock exllamav3 greedy + forward) runs on the GPU machine."""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
from pathlib import Path

import pytest
import torch

from glm53 import cli
from glm53.engine.exl3.tokenizer import HFTokenizer
from glm53.models.chat_template import ChatTemplate
from glm53.models.glm_special_tokens import SPECIAL_TOKENS
from glm53.tools import panel
from glm53.tools.synth import tokenizer_files

REPO = Path(__file__).resolve().parents[2]
SPECIAL = {t.text: t.glm_id for t in SPECIAL_TOKENS}
VOCAB = 154880


@pytest.fixture(scope="module")
def checkpoint_files(tmp_path_factory) -> Path:
    """A checkpoint's tokenizer and template files, as `glm53 synth` writes them."""
    d = tmp_path_factory.mktemp("ckpt")
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_files.tokenizer_json(VOCAB)))
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_files.tokenizer_config_json(202752)))
    return d


@pytest.fixture(scope="module")
def tokenizer(checkpoint_files) -> HFTokenizer:
    tokenizers = pytest.importorskip("tokenizers")
    return HFTokenizer(tokenizers.Tokenizer.from_file(str(checkpoint_files / "tokenizer.json")), VOCAB)


def test_default_prompts():
    prompts = panel.default_prompts()
    assert 8 <= len(prompts) <= 16 and len(set(prompts)) == len(prompts)
    assert all(isinstance(p, str) and p.strip() for p in prompts)


def test_prompt_files(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(["a", "b c"]))
    (tmp_path / "p.txt").write_text("first\n\n  second line \n")
    assert panel.load_prompts(tmp_path / "p.json") == ["a", "b c"]
    assert panel.load_prompts(tmp_path / "p.txt") == ["first", "second line"]
    assert panel.load_prompts(None) == panel.default_prompts()
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1}))
    (tmp_path / "empty.txt").write_text("\n \n")
    for name in ("bad.json", "empty.txt"):
        with pytest.raises(ValueError):
            panel.load_prompts(tmp_path / name)


def test_prompt_ids_are_the_thinking_off_chat_format(checkpoint_files, tokenizer):
    template = ChatTemplate.from_model_dir(checkpoint_files)
    ids = panel.prompt_ids(template, tokenizer.encode, "Hi there")
    head = [SPECIAL["[gMASK]"], SPECIAL["<sop>"], SPECIAL["<|user|>"]]
    tail = [SPECIAL["<|assistant|>"], SPECIAL["<think>"], SPECIAL["</think>"]]
    assert ids[:3] == head and ids[-3:] == tail
    assert tokenizer.decode(ids[3:-3]) == "Hi there"


def _rows(completion: list[int], vocab: int = 64, wrong: int | None = None) -> torch.Tensor:
    """[N + 1, vocab] logits whose argmax at completion position j is completion[j] (except at ``wrong``)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(len(completion) + 1, vocab, generator=g)
    for j, t in enumerate(completion):
        rows[j, t] = rows[j].max() + 3.0
        if j == wrong:
            rows[j, (t + 1) % vocab] = rows[j, t] + 1.0
    return rows


def test_panel_item_layout():
    ids, completion = [1, 2, 3], [10, 11, 12, 13]
    item = panel.panel_item("the prompt", ids, completion, _rows(completion), 20, "text")
    assert item["prompt"] == "the prompt" and item["completion"] == "text"
    assert item["prompt_len"] == 3 and item["tokens"] == ids + completion
    assert len(item["top20_ids"]) == len(item["top20_lp"]) == 5  # one per completion token, plus one after the end
    assert all(len(row) == 20 for row in item["top20_ids"])
    assert [row[0] for row in item["top20_ids"][:4]] == completion
    lp = torch.log_softmax(_rows(completion)[4].float(), -1)
    assert item["top20_lp"][4][0] == pytest.approx(float(lp.max()), abs=1e-6)
    assert all(a >= b for row in item["top20_lp"] for a, b in itertools.pairwise(row))
    assert panel.argmax_mismatches(item) == 0
    assert panel.argmax_mismatches(panel.panel_item("p", ids, completion, _rows(completion, wrong=2), 20, "")) == 1
    with pytest.raises(ValueError, match="expected 5"):
        panel.panel_item("p", ids, completion, _rows(completion)[:4], 20, "")


def test_a_panel_is_what_score_ref_panel_reads_and_scores_itself_perfectly(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    scorer = importlib.import_module("score_ref_panel")
    items = [panel.panel_item(f"p{i}", [1, 2, 3 + i], c, _rows(c), 20, "") for i, c in enumerate([[7, 8, 9], [20, 21]])]
    path = tmp_path / "panel.json"
    path.write_text(json.dumps(items))
    loaded = scorer.load_panel(str(path))
    for item in loaded:
        top = [dict(zip(ids, lps)) for ids, lps in zip(item["top20_ids"], item["top20_lp"])]
        score = scorer.score_item(item, [(t, {}) for t in top])
        assert score.top1 == len(item["top20_ids"]) and max(score.kls) == 0.0 and score.missing_ids == 0
        assert score.greedy == score.greedy_positions == len(item["tokens"]) - item["prompt_len"]


def test_checkpoint_facts_and_sidecar_path(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    facts = panel.checkpoint_facts(tmp_path)
    assert facts["config_sha256"] == hashlib.sha256(b'{"a": 1}').hexdigest()
    assert facts["index_sha256"] == hashlib.sha256(b'{"weight_map": {}}').hexdigest()
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "x.safetensors").write_bytes(b"123")
    assert panel.checkpoint_facts(tmp_path)["index_sha256"] == hashlib.sha256(b"x.safetensors 3").hexdigest()
    assert panel.meta_path(Path("reference/tiny-panel.json")) == Path("reference/tiny-panel.meta.json")


def test_command_line():
    ns = cli._parser().parse_args(["panel", "-m", "/ckpt", "--out", "p.json"])
    assert (ns.command, ns.model, ns.out, ns.max_new, ns.top_k, ns.prompts) == ("panel", Path("/ckpt"), Path("p.json"), 256, 20, None)
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["panel", "--out", "p.json"])
    assert cli.main(["panel", "-m", "/ckpt", "--out", "p.json", "--max-new", "0"]) == 2
