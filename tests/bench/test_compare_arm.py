"""bench/compare_arm.py's measurement against a stand-in generator and engine statistics (exllamav3's Job and
sampler replaced by stand-ins): job timing, the decode-phase hit rate from counter deltas, pinned bytes, and the
prompts every arm gets."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

from bench import compare_arm


class FakeJob:
    def __init__(self, input_ids, max_new_tokens, sampler, decode_special_tokens, identifier=None):
        self.ids, self.left, self.identifier = input_ids, max_new_tokens, identifier


class FakeGenerator:
    """Emits one token per iterate(); counts decode picks into engine statistics like glm53's cache."""

    def __init__(self):
        self.jobs, self.prompts = [], []
        self.stats = {"steps": 0, "offload": {"host_store": {"arena_bytes": 1234, "pinned": True},
                                              "cache": {"picks": 0, "hits": 0, "hit_rate": None, "oracle_hit_rate": 0.75,
                                                        "per_layer": [{"hits": 99, "picks": 99}]}}}

    def enqueue(self, job):
        self.jobs.append(job)
        self.prompts.append(job.ids[0].tolist())

    def num_remaining_jobs(self):
        return len(self.jobs)

    def iterate(self):
        """One decode step of every enqueued job (a batch), one token each."""
        out = []
        for job in list(self.jobs):
            job.left -= 1
            if job.left == 0:
                self.jobs.remove(job)
            cache = self.stats["offload"]["cache"]
            cache["picks"] += 8
            cache["hits"] += 6
            out.append({"stage": "streaming", "token_ids": torch.tensor([[7]]), "identifier": job.identifier})
        return out


@pytest.fixture
def fake_exllamav3(monkeypatch):
    monkeypatch.setitem(sys.modules, "exllamav3", types.SimpleNamespace(Job=FakeJob, ArgmaxSampler=lambda: None))


SPEC = {"seed": 1, "warmup_tokens": 4, "decode_reps": 2, "decode_context": 16, "decode_tokens": 10,
        "prefill_lengths": [32, 64], "prefill_reps": 2}


def test_measure(fake_exllamav3):
    gen = FakeGenerator()
    loaded = compare_arm.Loaded(gen, vocab=154880, stats=lambda: copy.deepcopy(gen.stats))
    result = compare_arm.measure(loaded, SPEC)
    assert len(result["decode_runs"]) == 2 and result["decode_tok_s"] > 0
    assert set(result["prefill_runs"]) == {"32", "64"} and all(len(v) == 2 for v in result["prefill_runs"].values())
    assert result["hit_rate"] == pytest.approx(0.75)  # 6 of 8 picks per step during the decode jobs
    assert result["oracle_hit_rate"] == 0.75 and result["pinned_bytes"] == 1234
    lengths = [len(p) for p in gen.prompts]
    assert lengths == [64, 16, 16, 32, 32, 64, 64]  # warm-up, decode jobs, prefill jobs
    assert len({tuple(p) for p in gen.prompts}) == len(gen.prompts)  # fresh prompts: no prefix-cache hits
    assert all(1000 <= t < 150000 for p in gen.prompts for t in p)


def test_streams_decode_together_and_report_their_aggregate_rate(fake_exllamav3):
    gen = FakeGenerator()
    result = compare_arm.measure(compare_arm.Loaded(gen, vocab=154880), {**SPEC, "streams": [2, 4]})
    assert set(result["decode_streams_tok_s"]) == {"2", "4"} and all(v > 0 for v in result["decode_streams_tok_s"].values())
    assert [len(p) for p in gen.prompts][7:] == [16] * 6  # after the single-stream phases: 2, then 4 fresh prompts
    assert len({tuple(p) for p in gen.prompts}) == len(gen.prompts)
    assert compare_arm.max_streams({"streams": [2, 4]}) == 4 and compare_arm.max_streams({}) == 1


def test_aggregate_rate_counts_only_while_every_stream_decodes():
    # stream 0: tokens at 0..10 s; stream 1 starts at 2 s and ends at 8 s: window (2, 8], 6 + 6 tokens
    times = [[float(t) for t in range(11)], [float(t) for t in range(2, 9)]]
    assert compare_arm.aggregate_decode_rate(times) == pytest.approx(12 / 6)
    with pytest.raises(ValueError, match="never decoded together"):
        compare_arm.aggregate_decode_rate([[0.0, 1.0], [2.0, 3.0]])


def test_the_same_prompts_for_every_arm():
    assert compare_arm.random_prompt(1, 2, 0, 512, 154880) == compare_arm.random_prompt(1, 2, 0, 512, 154880)
    assert compare_arm.random_prompt(1, 2, 0, 512, 154880) != compare_arm.random_prompt(1, 2, 1, 512, 154880)
    assert max(compare_arm.random_prompt(1, 2, 0, 4096, 2000)) < 2000


def test_stock_arms_have_no_cache_statistics(fake_exllamav3):
    result = compare_arm.measure(compare_arm.Loaded(FakeGenerator(), vocab=154880), SPEC)
    assert (result["hit_rate"], result["oracle_hit_rate"], result["pinned_bytes"], result["engine_stats"]) == (None, None, None, None)


def test_hit_rate_from_counter_deltas():
    before = {"offload": {"cache": {"hits": 10, "picks": 20}}}
    after = {"offload": {"cache": {"hits": 40, "picks": 60}}}
    assert compare_arm.phase_hit_rate(before, after) == 0.75
    assert compare_arm.phase_hit_rate(before, before) is None
    assert compare_arm.phase_hit_rate(None, after) is None
    assert compare_arm.decode_rate([0.0, 0.5, 1.0]) == 2.0


class FakePrefetcher:
    def __init__(self, log):
        self.log = log

    def record(self):
        self.log.append("record")

    def recorded(self):
        return ["picks"]

    def replay(self, picks):
        self.log.append(("replay", picks))


def test_the_oracle_arm_runs_each_decode_job_twice_and_times_the_replay(fake_exllamav3):
    gen, log = FakeGenerator(), []
    loaded = compare_arm.Loaded(gen, vocab=154880, stats=lambda: copy.deepcopy(gen.stats), oracle=FakePrefetcher(log))
    result = compare_arm.measure(loaded, SPEC)
    assert len(result["decode_runs"]) == 2 and result["oracle_same_tokens"] is True
    assert log == ["record", ("replay", ["picks"]), "record", ("replay", ["picks"]), ("replay", None)]
    lengths = [len(p) for p in gen.prompts]
    assert lengths == [64, 16, 16, 16, 16, 32, 32, 64, 64]  # each decode prompt twice: recorded, then replayed
    assert gen.prompts[1] == gen.prompts[2] != gen.prompts[3] == gen.prompts[4]
    assert "oracle_same_tokens" not in compare_arm.measure(compare_arm.Loaded(FakeGenerator(), vocab=154880), SPEC)


def test_a_project_arm_records_preflights_ram_estimate_and_its_routed_experts(tmp_path):
    from glm53 import config, preflight
    from glm53.models import checkpoint
    from tests.test_preflight import expert_checkpoint

    d = expert_checkpoint(tmp_path)
    for mode in ("exact", "fast"):
        settings = config.load(["--mode", mode, "--engine", "exl3", "-m", str(d)], {})
        figures = compare_arm.ram_estimate(settings)
        assert set(figures) == {"preflight_ram_gb"}  # the routed experts' bytes are the checkpoint's, recorded once
        assert figures["preflight_ram_gb"] == preflight.ram_needed(checkpoint.expert_bytes(d), settings) / 1e9
