"""The exllamav3 backend's translation of generator results, on the CPU with a stand-in generator.

(Everything that needs exllamav3 itself runs in tests/gpu.)"""

import torch

from glm53.engine.exl3.backend import Exl3Backend
from glm53.engine.interface import LogprobRequest, SequenceFailure


class FakeJob:
    def __init__(self, identifier, cached_pages=0, cached_tokens=0):
        self.identifier = identifier
        self.cached_pages = cached_pages  # whole pages from the page cache
        self.cached_tokens = cached_tokens  # the start of a partial page copied from a matching one


class FakeGenerator:
    def __init__(self, results):
        self.results = results

    def iterate(self):
        return self.results


class FakeOffload:
    """Records the backend's calls around each step (the offload hands them to its parts: the CPU tier's worker)."""

    def __init__(self):
        self.calls = []

    def before_step(self):
        self.calls.append("before")

    def after_step(self):
        self.calls.append("after")


def backend_with(results, jobs, prefilling=(), offload=None):
    b = object.__new__(Exl3Backend)  # no model: only step()'s bookkeeping is under test
    b.offload = offload or FakeOffload()
    b.generator = FakeGenerator(results)
    b._jobs = jobs
    b._prefilling = set(prefilling)
    b._page_size = 256
    b._counters = {"steps": 0, "decode_tokens": 0}
    return b


def test_tokens_logprobs_and_a_contained_job_failure():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]])  # [1, 2 tokens, V]
    results = [
        {"stage": "prefill", "identifier": 1},
        {"stage": "streaming", "identifier": 1, "job": FakeJob(1, 2, 5), "token_ids": torch.tensor([[1, 0]]), "logits": logits},
        {"stage": "streaming", "identifier": 2, "job": FakeJob(2, 1, 0), "token_ids": torch.tensor([[2]])},
        {"stage": "error", "job": FakeJob(3), "serial": 7, "eos": True, "error": RuntimeError("non-finite logits")},
        {"stage": "streaming", "identifier": 99, "token_ids": torch.tensor([[1]])},  # removed already: ignored
    ]
    b = backend_with(results, {1: LogprobRequest(top_n=1), 2: None, 3: None}, prefilling={1, 3})
    out = b.step()
    assert [t.token_id for t in out[1]] == [1, 0] and out[1][0].logprobs.top[0][0] == 1
    # sequence 1's first token says how much of its prompt came from the page cache; 2 had its first token before
    assert [t.cached_prompt_tokens for t in out[1]] == [2 * 256 + 5, 0] and out[2][0].cached_prompt_tokens == 0
    assert b._prefilling == {3}
    assert [t.token_id for t in out[2]] == [2] and out[2][0].logprobs is None
    assert out[3] == SequenceFailure("RuntimeError: non-finite logits")
    assert 99 not in out and b._counters == {"steps": 1, "decode_tokens": 3}


def test_the_offload_is_told_before_and_after_every_step_and_tokens_pass_through():
    """A late CPU-tier job is computed on the GPU inside the step (the fallback), so a step's tokens are always
    returned; the backend only tells the offload (whose CPU tier wakes its worker) before the step and after it."""
    results = [
        {"stage": "streaming", "identifier": 1, "job": FakeJob(1, 0, 0), "token_ids": torch.tensor([[4]])},
        {"stage": "streaming", "identifier": 2, "job": FakeJob(2, 0, 0), "token_ids": torch.tensor([[5]])},
    ]
    offload = FakeOffload()
    b = backend_with(results, {1: None, 2: None}, offload=offload)
    out = b.step()
    assert [t.token_id for t in out[1]] == [4] and [t.token_id for t in out[2]] == [5]
    b.step()
    assert offload.calls == ["before", "after", "before", "after"]
