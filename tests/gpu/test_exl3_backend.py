"""The GPU backend against a plain exllamav3 generator on the same checkpoint, in one process.

Tokens and log-probabilities must be bit-identical: the backend only drives exllamav3, it must not change a
single number. Log-probabilities of the reference are computed from its raw logits with the same function the
backend uses, so equality of those floats means equality of the logits' log-softmax.
"""

from __future__ import annotations

import math

import pytest
import torch

from glm53 import config
from glm53.engine.interface import LogprobRequest, SamplingParams, SequenceFailure
from glm53.engine.sampling import logprobs_for

CACHE_TOKENS = 16384
CHUNK = 2048
PROMPTS = [[154822, 154824, 154827] + list(range(300, 300 + n)) + [154828, 154841] for n in (5, 40, 300)]


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    from glm53.engine.exl3.backend import Exl3Backend

    # exact mode: the contract these tests check is equality with plain exllamav3 (its prefill schedule included)
    settings = config.load(["--engine", "exl3", "--mode", "exact", "-m", str(tiny_checkpoint), "-cs", str(CACHE_TOKENS), "--max-batch-size", "4",
                            "-ambs", "4", "-chunk_size", str(CHUNK)], {})
    b = Exl3Backend(settings)
    yield b
    b.close()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Stock exllamav3, set up the way its own model_init does, with the same sizes."""
    from glm53.engine.exl3.stock import load_stock

    stock = load_stock(tiny_checkpoint, cache_tokens=CACHE_TOKENS, max_batch_size=4, chunk_size=CHUNK)
    gen = stock.generator(max_batch_size=4)
    yield stock.model, gen
    gen.close()
    stock.close()


def reference_greedy(gen, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    from glm53.engine.exl3.stock import greedy_job

    gen.enqueue(greedy_job(prompt, n, return_logits=True, decode_special_tokens=True))
    ids, logits = [], []
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") == "streaming" and r.get("token_ids") is not None and r["token_ids"].numel():
                ids += r["token_ids"][0].tolist()
                logits.append(r["logits"][0])
    return ids, torch.cat(logits)


def backend_greedy(backend, seq_id: int, prompt: list[int], n: int, request: LogprobRequest):
    backend.add(seq_id, prompt, SamplingParams(temperature=0.0), request)
    tokens = []
    for _ in range(4 * n + 64):  # a bound, so a stuck sequence fails the test instead of hanging it
        got = backend.step().get(seq_id, [])
        assert not isinstance(got, SequenceFailure), f"sequence {seq_id} failed: {got.reason}"
        tokens += got
        if len(tokens) >= n:
            break
    backend.remove(seq_id)
    assert len(tokens) >= n, f"sequence {seq_id} produced {len(tokens)} of {n} tokens"
    return tokens[:n]


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_tokens_and_logprobs_equal_plain_exllamav3(backend, reference, index):
    n = 24
    request = LogprobRequest(top_n=5, token_ids=(154820, 300))
    ref_ids, ref_logits = reference_greedy(reference[1], PROMPTS[index], n)
    got = backend_greedy(backend, 100 + index, PROMPTS[index], n, request)
    assert [t.token_id for t in got] == ref_ids
    for i, tok in enumerate(got):
        want = logprobs_for(ref_logits[i].float()[: backend.info.vocab_size], ref_ids[i], request)
        assert tok.logprobs == want, f"position {i}"


def test_a_repeated_prompt_reuses_the_prefix_cache_and_gives_the_same_tokens(backend):
    """The second run of a prompt starts from exllamav3's cached pages (and recurrent checkpoint), and its first
    token says how many prompt tokens that saved: every whole page before the prompt's last token."""
    from glm53.engine.exl3.load import page_size

    page = page_size()
    prompt = PROMPTS[2] + [500] * 700
    first = backend_greedy(backend, 300, prompt, 16, None)
    second = backend_greedy(backend, 301, prompt, 16, None)
    assert [t.token_id for t in first] == [t.token_id for t in second]
    # the first run may reuse the first page of PROMPTS[2] (310 tokens), which an earlier test ran
    assert first[0].cached_prompt_tokens in (0, page)
    assert second[0].cached_prompt_tokens == (len(prompt) - 1) // page * page
    assert all(t.cached_prompt_tokens == 0 for t in first[1:] + second[1:])


def test_score_equals_a_plain_forward(backend, reference):
    model = reference[0]
    ids = PROMPTS[1]
    request = LogprobRequest(top_n=3)
    entries = list(backend.score(ids, 0, request))[-1]
    with torch.inference_mode():
        logits = model.forward(torch.tensor([ids]), {"attn_mode": "flash_attn_nc"})[0].float()
    assert entries[0] is None
    for p in range(1, len(ids)):
        assert entries[p] == logprobs_for(logits[p - 1, : backend.info.vocab_size], ids[p], request), f"position {p}"


def test_scoring_longer_than_a_chunk_is_refused(backend):
    with pytest.raises(ValueError, match="at most"):
        next(backend.score(list(range(300, 300 + CHUNK + 1)), 0, LogprobRequest()))


def test_uncapped_jobs_all_start_at_once(backend):
    """Pages are reserved in rounds: four long prompts with no length limit all produce tokens promptly."""
    prompts = [[154822, 154824] + [400 + i] * 1000 for i in range(4)]
    for i, p in enumerate(prompts):
        backend.add(200 + i, p, SamplingParams(temperature=0.0))
    started: set[int] = set()
    for _ in range(12):
        started |= set(backend.step())
        if len(started) == 4:
            break
    for i in range(4):
        backend.remove(200 + i)
    assert started == {200, 201, 202, 203}


def test_activations_stay_finite_and_bounded(backend):
    """The synthetic weights' scales keep the residual stream O(1): logits finite with a sane spread."""
    ids = PROMPTS[2]
    entries = list(backend.score(ids, 1, LogprobRequest(top_n=1)))[-1]
    lps = [e.logprob for e in entries]
    assert all(math.isfinite(x) for x in lps)
    # a random model is far from certain and far from uniform over 154,880 tokens (log 154880 = 11.95)
    assert -40 < sum(lps) / len(lps) < -1


def test_facts(backend):
    assert backend.info.architecture == "Glm5NextForConditionalGeneration"
    assert {154820, 154827, 154829} <= backend.info.eos_token_ids
    assert backend.tokenizer.encode("[gMASK]<sop><|user|>") == [154822, 154824, 154827]
    assert backend.tokenizer.decode([154841, 154842]) == "<think></think>"
