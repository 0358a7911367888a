"""bench/decode_kl.py bookkeeping with scripted paths (no GPU, no exllamav3): full-vocabulary KL, top-1 agreement,
the first divergence, teacher forcing of B on A's tokens, and the summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench import decode_kl

V = 50


class ScriptedPath:
    """Logits that are a fixed function of the whole prefix; ``bump`` makes given decode steps prefer another
    token (step -> token), ``scale`` sharpens or flattens the distribution."""

    def __init__(self, bump: dict[int, int] | None = None, scale: float = 1.0):
        self.bump, self.scale = bump or {}, scale
        self.fed: list[list[int]] = []  # the token_ids of every logits() call
        self.resets = 0

    def reset(self) -> None:
        self.prefix: list[int] = []
        self.step = 0
        self.resets += 1

    def logits(self, token_ids) -> torch.Tensor:
        self.fed.append(list(token_ids))
        self.prefix += list(token_ids)
        rng = np.random.default_rng([len(self.prefix), sum(self.prefix) % 997])
        row = torch.from_numpy(rng.normal(size=V)).float() * self.scale
        if self.step in self.bump:
            row[self.bump[self.step]] = row.max() + 5.0
        self.step += 1
        return row


def test_identical_paths_agree_everywhere_with_zero_kl():
    record = decode_kl.paired_decode(ScriptedPath(), ScriptedPath(), [5, 6, 7], 12)
    assert record.kls == [0.0] * 12
    assert all(record.agree) and record.first_divergence is None and record.margins == []


def test_divergence_is_counted_and_b_keeps_following_a():
    a, b = ScriptedPath(), ScriptedPath(bump={3: 0, 7: 1})
    record = decode_kl.paired_decode(a, b, [5, 6, 7], 10)
    assert record.first_divergence == 3
    assert [i for i, ok in enumerate(record.agree) if not ok] == [3, 7]
    assert len(record.margins) == 2 and all(m > 0 for m in record.margins)
    # B was fed exactly A's tokens (teacher forcing): the prompt, then one token per step but the last
    assert a.fed == b.fed and len(a.fed) == 10 and a.fed[0] == [5, 6, 7]
    assert a.resets == b.resets == 2  # before, and after to give back the cache slot
    # away from the bumped steps the paths agree exactly
    assert all(record.kls[i] == 0.0 for i in range(10) if i not in (3, 7))
    assert record.kls[3] > 0 and record.kls[7] > 0


def test_a_flatter_b_gives_positive_kl_without_changing_the_argmax():
    record = decode_kl.paired_decode(ScriptedPath(), ScriptedPath(scale=0.5), [1, 2], 8)
    assert all(record.agree)
    assert all(k > 0 for k in record.kls)


def test_kl_full_matches_a_numpy_reference():
    rng = np.random.default_rng(3)
    for _ in range(5):
        a, b = rng.normal(size=V) * 3, rng.normal(size=V) * 3
        pa = np.exp(a - a.max()) / np.exp(a - a.max()).sum()
        pb = np.exp(b - b.max()) / np.exp(b - b.max()).sum()
        want = float((pa * (np.log(pa) - np.log(pb))).sum())
        assert decode_kl.kl_full(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)) == pytest.approx(want, rel=1e-5)


def test_kl_of_equal_rows_is_exactly_zero():
    row = torch.randn(V)
    assert decode_kl.kl_full(row, row.clone()) == 0.0


def test_margin():
    row = torch.full((V,), -10.0)
    row[4], row[9] = 2.0, 1.0
    lp = torch.log_softmax(row.double(), -1)
    assert decode_kl.margin(row) == pytest.approx(float(lp[4] - lp[9]))


@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_is_numpys(q):
    values = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2]
    assert decode_kl.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summary_over_prompts():
    records = [decode_kl.paired_decode(ScriptedPath(), ScriptedPath(bump={2: 0}), [1], 5),
               decode_kl.paired_decode(ScriptedPath(), ScriptedPath(), [2, 3], 5)]
    s = decode_kl.summarise(records)
    assert s["positions"] == 10
    assert s["top1_agree"] == pytest.approx(0.9)
    assert s["first_divergence"] == [2, None]
    assert s["disagreements"] == 1
    assert s["kl_max"] == max(records[0].kls)
    assert s["kl_mean"] == pytest.approx(sum(records[0].kls) / 10)
    assert math.isclose(s["kl_p99"], decode_kl.percentile(records[0].kls + records[1].kls, 99))
    assert [p["positions"] for p in s["per_prompt"]] == [5, 5]
    assert s["per_prompt"][0]["first_divergence"] == 2 and s["per_prompt"][1]["kl_max"] == 0.0


def test_path_registry():
    with pytest.raises(ValueError, match="unknown path 'exactish'.*exact, fast, perturbed, stock"):
        decode_kl.make_path("exactish", None, None, V)
    with pytest.raises(ValueError, match="relative size"):
        decode_kl.make_path("perturbed", None, None, V)
    assert set(decode_kl.PATHS) == {"stock", "perturbed"} and set(decode_kl.ENGINE_PATHS) == {"exact", "fast"}
    with pytest.raises(ValueError, match="stock paths need a stock load"):
        decode_kl.make_engine_path("stock", None, None)


def test_engine_paths_pause_the_cpu_tier_for_exact_and_need_it_for_fast():
    import contextlib

    class Tier:
        paused = staticmethod(contextlib.nullcontext)

    def backend(fast):
        return type("B", (), {"model": FakeModel(), "offload": type("O", (), {"tier": fast})(),
                              "info": type("I", (), {"vocab_size": V})()})()

    tier = Tier()
    exact = decode_kl.make_engine_path("exact", backend(tier), FakeCache())
    assert exact.mode is tier.paused and exact.vocab_size == V
    assert decode_kl.make_engine_path("fast", backend(tier), FakeCache()).mode is contextlib.nullcontext
    with pytest.raises(ValueError, match="CPU tier"):
        decode_kl.make_engine_path("fast", backend(None), FakeCache())
    argv = decode_kl.engine_argv("/ckpt", 2048, "--ec-cache-experts 50% --ct-threads 4")
    assert argv[:6] == ["--engine", "exl3", "--mode", "fast", "--ct-enable", "1"] and argv[-4:] == ["--ec-cache-experts", "50%", "--ct-threads", "4"]


def test_arguments():
    args = decode_kl.parse_args(["-m", "/ckpt", "--b", "perturbed:0.001"])
    assert (args.a, args.b, args.tokens, args.max_prompts) == ("stock", "perturbed:0.001", 256, 6)
    with pytest.raises(SystemExit):
        decode_kl.parse_args(["-m", "/ckpt", "--b", "stock", "--tokens", "0"])
    with pytest.raises(SystemExit):  # a stock path against an engine path: two different loads
        decode_kl.parse_args(["-m", "/ckpt", "--a", "stock", "--b", "fast"])
    args = decode_kl.parse_args(["-m", "/ckpt", "--a", "exact", "--b", "fast"])
    assert args.engine_args == "--ec-cache-experts 11%"


class FakeCache:
    max_num_tokens = 1000  # ModelPath uses whole pages: 768

    def __init__(self):
        self.released = []

    def release_state(self, state):
        self.released.append(state)


class FakeModel:
    """Records the params of each forward; creates a recurrent state on the first one as exllamav3 does."""

    def __init__(self):
        self.calls = []

    def forward(self, ids, params):
        self.calls.append((ids.tolist(), dict(params)))
        if params["past_len"] == 0:
            assert "recurrent_states" not in params
            params["recurrent_states"] = [f"state{len(self.calls)}"]
        return torch.arange(ids.shape[1] * (V + 6), dtype=torch.float32).reshape(1, ids.shape[1], V + 6)


def test_model_path_feeds_one_sequence_through_the_cache():
    model, cache = FakeModel(), FakeCache()
    path = decode_kl.ModelPath(model, cache, V)
    path.reset()
    row = path.logits([1, 2, 3])
    assert row.shape == (V,)  # the vocabulary, not the padded head
    assert row[0] == 2 * (V + 6)  # the last position's row
    path.logits([4])
    path.logits([5])
    (ids0, p0), (ids1, p1), (ids2, p2) = model.calls
    assert (ids0, ids1, ids2) == ([[1, 2, 3]], [[4]], [[5]])
    assert [p["past_len"] for p in (p0, p1, p2)] == [0, 3, 4]
    assert all(p["batch_shape"] == (1, 768) and p["attn_mode"] == "flash_attn" and p["cache"] is cache for p in (p0, p1, p2))
    assert p1["recurrent_states"] == ["state1"] and p2["recurrent_states"] == ["state1"]
    path.reset()
    assert cache.released == ["state1"]
    path.logits([9])
    assert model.calls[-1][1]["past_len"] == 0
    with pytest.raises(ValueError, match="exceeds the cache"):
        path.logits(list(range(800)))


def test_mode_is_entered_around_every_forward():
    entered = []

    class Mode:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    path = decode_kl.ModelPath(FakeModel(), FakeCache(), V, mode=Mode)
    path.reset()
    path.logits([1])
    path.logits([2])
    assert entered == ["in", "out", "in", "out"]


def test_perturbation_has_the_requested_relative_size_and_repeats_after_reset():
    p = object.__new__(decode_kl.Perturbation)  # the arithmetic only: no model to wrap
    p.rel, p.seed, p.enabled, p.generator = 1e-2, 0, False, torch.Generator()
    y = torch.randn(64, 512, dtype=torch.float16)
    p.reset()
    first = p._perturb(y)
    p.reset()
    assert torch.equal(first, p._perturb(y))
    noise = (first.float() - y.float()).norm(dim=-1) / y.float().norm(dim=-1)
    assert first.dtype == y.dtype and first.shape == y.shape
    assert noise.mean().item() == pytest.approx(1e-2, rel=0.1)


class FakeTap:
    """Stands in for LayerTap: each path's forward leaves per-layer rows, as the real tap's wrappers do."""

    def __init__(self):
        self.rows = None

    def take(self):
        rows, self.rows = self.rows, None
        assert rows is not None, "take() without a forward"
        return rows


class TappedPath(ScriptedPath):
    def __init__(self, tap: FakeTap, layer_scale: list[float], **kw):
        super().__init__(**kw)
        self.tap, self.layer_scale = tap, layer_scale

    def logits(self, token_ids):
        row = super().logits(token_ids)
        self.tap.rows = [torch.ones(8) * s for s in self.layer_scale]
        return row


def test_layer_outputs_of_the_two_paths_are_compared_at_every_position():
    tap = FakeTap()
    a, b = TappedPath(tap, [1.0, 2.0, 4.0]), TappedPath(tap, [1.0, 2.2, 3.0])
    record = decode_kl.paired_decode(a, b, [5, 6], 6, tap)
    assert len(record.layer_errs) == 6  # the prompt's forward, then one per decode step but the last
    for errs in record.layer_errs:
        assert errs == pytest.approx([0.0, 0.1, 0.25])
    summary = decode_kl.summarise([record])["layer_rel_err"]
    assert summary["mean"] == pytest.approx([0.0, 0.1, 0.25]) and summary["max"] == pytest.approx([0.0, 0.1, 0.25])
    assert decode_kl.summarise([decode_kl.paired_decode(ScriptedPath(), ScriptedPath(), [1], 3)])["layer_rel_err"] is None


def test_relative_errors():
    a = [torch.tensor([3.0, 4.0]), torch.zeros(2), torch.zeros(2)]
    b = [torch.tensor([3.0, 5.0]), torch.zeros(2), torch.ones(2)]
    assert decode_kl.relative_errors(a, b) == [pytest.approx(0.2), 0.0, math.inf]
    with pytest.raises(ValueError, match="2 layer outputs from A but 3"):
        decode_kl.relative_errors(a[:2], b)
