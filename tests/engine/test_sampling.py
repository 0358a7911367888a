import math
from collections import Counter

import pytest
import torch

from glm53.engine.interface import LogprobRequest, SamplingParams
from glm53.engine.sampling import logprobs_for, sample

GREEDY = SamplingParams(temperature=0.0)


def draw(logits, params, seed=0, n=1, history=None):
    """``n`` tokens for one row from one seeded generator, as a list."""
    g = torch.Generator().manual_seed(seed)
    row = torch.tensor([logits], dtype=torch.float32)
    return [int(sample(row, [params], [g], [history])[0]) for _ in range(n)]


def probs_logits(*probs):
    return [math.log(p) for p in probs]


def test_greedy_takes_the_argmax_and_breaks_ties_by_lower_id():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 3.0]])
    assert sample(logits, [GREEDY, GREEDY], [None, None], [None, None]).tolist() == [1, 0]


def test_greedy_draws_no_random_numbers():
    g = torch.Generator().manual_seed(5)
    before = g.get_state()
    sample(torch.randn(1, 10), [GREEDY], [g], [None])
    assert torch.equal(g.get_state(), before)


def test_sample_leaves_the_logits_alone():
    logits = torch.randn(2, 10)
    copy = logits.clone()
    params = [SamplingParams(presence_penalty=1.0, logit_bias=((3, 5.0),)), GREEDY]
    sample(logits, params, [None, None], [torch.ones(10), None])
    assert torch.equal(logits, copy)


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_and_tiny_top_p_equal_greedy(seed):
    logits = torch.randn(20, generator=torch.Generator().manual_seed(seed)).tolist()
    best = max(range(20), key=lambda i: logits[i])
    assert draw(logits, SamplingParams(top_k=1), seed, n=20) == [best] * 20
    assert draw(logits, SamplingParams(top_p=1e-6), seed, n=20) == [best] * 20


def test_top_k_keeps_the_k_most_likely():
    logits = probs_logits(0.1, 0.4, 0.2, 0.3)
    assert set(draw(logits, SamplingParams(top_k=2), n=300)) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Sorted: 0.5 (id 2), 0.3 (id 0), 0.15 (id 3), 0.05 (id 1); the mass before id 3 is 0.8 >= 0.75.
    logits = probs_logits(0.3, 0.05, 0.5, 0.15)
    assert set(draw(logits, SamplingParams(top_p=0.75), n=300)) == {0, 2}


def test_min_p_drops_tokens_below_a_share_of_the_best():
    # min_p 0.5 of the best 0.5 is 0.25: 0.3 survives, 0.15 and 0.05 do not.
    logits = probs_logits(0.3, 0.05, 0.5, 0.15)
    assert set(draw(logits, SamplingParams(min_p=0.5), n=300)) == {0, 2}


def test_sampling_follows_the_distribution():
    counts = Counter(draw(probs_logits(0.7, 0.2, 0.1), SamplingParams(), n=4000))
    assert counts[0] / 4000 == pytest.approx(0.7, abs=0.03)
    assert counts[1] / 4000 == pytest.approx(0.2, abs=0.03)
    assert counts[2] / 4000 == pytest.approx(0.1, abs=0.03)


def test_low_temperature_sharpens_high_temperature_flattens():
    logits = probs_logits(0.6, 0.4)
    cold = Counter(draw(logits, SamplingParams(temperature=0.1), n=1000))
    hot = Counter(draw(logits, SamplingParams(temperature=100.0), n=1000))
    assert cold[0] / 1000 == pytest.approx(1.5**10 / (1.5**10 + 1), abs=0.015)  # 0.983
    assert hot[0] / 1000 == pytest.approx(1.5**0.01 / (1.5**0.01 + 1), abs=0.05)  # 0.501


def test_logit_bias_forces_a_token():
    logits = [5.0, 0.0, 1.0]
    bias = ((1, 100.0),)
    assert draw(logits, SamplingParams(temperature=0.0, logit_bias=bias)) == [1]
    assert draw(logits, SamplingParams(logit_bias=bias), n=50) == [1] * 50


def test_logit_bias_can_ban_a_token():
    assert draw([5.0, 0.0, 1.0], SamplingParams(temperature=0.0, logit_bias=((0, -100.0),))) == [2]


def test_presence_penalty_changes_the_argmax():
    history = torch.tensor([1.0, 0.0, 0.0])  # token 0 was generated once
    assert draw([2.0, 1.5, 0.0], SamplingParams(temperature=0.0, presence_penalty=1.0), history=history) == [1]
    assert draw([2.0, 1.5, 0.0], SamplingParams(temperature=0.0, presence_penalty=0.4), history=history) == [0]


def test_frequency_penalty_scales_with_the_count():
    params = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    assert draw([2.0, 1.5, 0.0], params, history=torch.tensor([2.0, 0.0, 0.0])) == [0]  # 2 - 0.4 = 1.6 > 1.5
    assert draw([2.0, 1.5, 0.0], params, history=torch.tensor([3.0, 0.0, 0.0])) == [1]  # 2 - 0.6 = 1.4 < 1.5


def test_same_seed_same_tokens():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=1.5)
    assert draw(logits, params, seed=7, n=30) == draw(logits, params, seed=7, n=30)
    assert draw(logits, params, seed=7, n=30) != draw(logits, params, seed=8, n=30)


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    alone_gen = torch.Generator().manual_seed(3)
    alone = [int(sample(logits[1:2], [params], [alone_gen], [None])[0]) for _ in range(30)]
    gens = [torch.Generator().manual_seed(s) for s in (10, 3, 11, 12)]
    others = [SamplingParams(temperature=0.7, top_k=5), params, GREEDY, SamplingParams(min_p=0.2)]
    batched = [int(sample(logits, others, gens, [None] * 4)[1]) for _ in range(30)]
    assert batched == alone


def test_logprobs_by_hand():
    # log_softmax([1, 2, 3]) = [1, 2, 3] - (3 + log(1 + e^-1 + e^-2))
    lse = 3 + math.log(1 + math.exp(-1) + math.exp(-2))
    result = logprobs_for(torch.tensor([1.0, 2.0, 3.0]), 0, LogprobRequest(top_n=2, token_ids=(1, 0)))
    assert result.logprob == pytest.approx(1 - lse)
    assert [i for i, _ in result.top] == [2, 1]
    assert [v for _, v in result.top] == pytest.approx([3 - lse, 2 - lse])
    assert [i for i, _ in result.requested] == [1, 0]
    assert [v for _, v in result.requested] == pytest.approx([2 - lse, 1 - lse])


def test_logprobs_top_breaks_ties_by_lower_id():
    result = logprobs_for(torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0]), 2, LogprobRequest(top_n=4))
    assert [i for i, _ in result.top] == [1, 3, 4, 0]


def test_logprobs_for_rows_gives_one_entry_per_row():
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    first, second = logprobs_for(logits, [1, 1], LogprobRequest())
    assert first.logprob == pytest.approx(math.log(0.5))
    assert second.logprob == pytest.approx(math.log(0.75))
    assert first.top == () and first.requested == ()


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-38])
def test_a_vanishing_temperature_samples_the_argmax(temperature):
    # below float32's smallest normal the division used to overflow to NaN and pick token 0
    assert draw([0.0, 3.0, 1.0, 2.9], SamplingParams(temperature=temperature), n=5) == [1] * 5
