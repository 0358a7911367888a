"""The exllamav3 backend's translation of generator results, on the CPU with a stand-in generator.

(Everything that needs exllamav3 itself runs in tests/gpu.)"""

import torch

from glm53.engine.exl3.backend import Exl3Backend
from glm53.engine.interface import LogprobRequest, SequenceFailure


class FakeJob:
    def __init__(self, identifier):
        self.identifier = identifier


class FakeGenerator:
    def __init__(self, results):
        self.results = results

    def iterate(self):
        return self.results


def backend_with(results, jobs):
    b = object.__new__(Exl3Backend)  # no model: only step()'s bookkeeping is under test
    b.generator = FakeGenerator(results)
    b._jobs = jobs
    b._counters = {"steps": 0, "decode_tokens": 0}
    return b


def test_tokens_logprobs_and_a_contained_job_failure():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]])  # [1, 2 tokens, V]
    results = [
        {"stage": "prefill", "identifier": 1},
        {"stage": "streaming", "identifier": 1, "token_ids": torch.tensor([[1, 0]]), "logits": logits},
        {"stage": "streaming", "identifier": 2, "token_ids": torch.tensor([[2]])},
        {"stage": "error", "job": FakeJob(3), "serial": 7, "eos": True, "error": RuntimeError("non-finite logits")},
        {"stage": "streaming", "identifier": 99, "token_ids": torch.tensor([[1]])},  # removed already: ignored
    ]
    b = backend_with(results, {1: LogprobRequest(top_n=1), 2: None, 3: None})
    out = b.step()
    assert [t.token_id for t in out[1]] == [1, 0] and out[1][0].logprobs.top[0][0] == 1
    assert [t.token_id for t in out[2]] == [2] and out[2][0].logprobs is None
    assert out[3] == SequenceFailure("RuntimeError: non-finite logits")
    assert 99 not in out and b._counters == {"steps": 1, "decode_tokens": 3}
