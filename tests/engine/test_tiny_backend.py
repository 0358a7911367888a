import pytest
import torch
import torch.nn.functional as F

from glm53.engine.interface import LogprobRequest, SamplingParams
from glm53.engine.tiny.backend import TinyBackend
from glm53.engine.tiny.model import KVPool, TinyConfig, swiglu

GREEDY = SamplingParams(temperature=0.0)
ALL_LOGPROBS = LogprobRequest(top_n=288)  # the whole vocabulary: compares full distributions


def backend(chunk_size=4096, seed=0, context_length=512):
    return TinyBackend(context_length=context_length, max_batch_size=8, chunk_size=chunk_size, seed=seed)


def prompt(length, seed):
    return torch.randint(0, 288, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(b, prompts, n, sampling=GREEDY, logprobs=None):
    """Add ``prompts`` as sequences 0, 1, ...; step until each has ``n`` tokens: {seq_id: [SampledToken]}."""
    for i, p in enumerate(prompts):
        b.add(i, p, sampling, logprobs)
    out = {i: [] for i in range(len(prompts))}
    while any(len(tokens) < n for tokens in out.values()):
        for seq_id, tokens in b.step().items():
            out[seq_id].extend(tokens)
    return {i: tokens[:n] for i, tokens in out.items()}


def ids(tokens):
    return [t.token_id for t in tokens]


def assert_same_distributions(a, b, tol=1e-4):
    assert ids(a) == ids(b)
    for x, y in zip(a, b):
        assert x.logprobs.logprob == pytest.approx(y.logprobs.logprob, abs=tol)
        assert dict(x.logprobs.top) == pytest.approx(dict(y.logprobs.top), abs=tol)


def test_info_describes_the_demo_model():
    b = backend()
    assert b.info.name == "glm53-tiny"
    assert b.info.vocab_size == b.tokenizer.vocab_size == 288
    assert {b.tokenizer.decode([i]) for i in b.info.eos_token_ids} == {"<|endoftext|>", "<|user|>", "<|observation|>"}
    assert b.info.facts["seed"] == 0
    assert b.info.facts["parameters"] == sum(p.numel() for p in b.model.parameters())


def test_same_seed_same_outputs_other_seed_other_outputs():
    prompts = [prompt(20, 1), prompt(9, 2)]
    sampled = SamplingParams(temperature=1.0, seed=42)
    first = run(backend(seed=3), prompts, 30, sampled)
    assert first == run(backend(seed=3), prompts, 30, sampled)
    assert first != run(backend(seed=4), prompts, 30, sampled)


def test_batching_and_padding_do_not_change_results():
    prompts = [prompt(37, 1), prompt(5, 2), prompt(90, 3), prompt(61, 4)]
    alone = run(backend(), prompts[:1], 40, logprobs=ALL_LOGPROBS)[0]
    batched = run(backend(), prompts, 40, logprobs=ALL_LOGPROBS)[0]
    assert_same_distributions(alone, batched)


def test_a_batch_with_a_gap_in_its_slots_is_unchanged():
    # Sequences in slots 0 and 2 decode together after the one in slot 1 left: their caches are not one
    # slice of the pool any more.
    b = backend()
    for seq_id, length in enumerate((30, 18, 12)):
        b.add(seq_id, prompt(length, seq_id), GREEDY, ALL_LOGPROBS)
    out = b.step()[2]
    b.remove(1)
    while len(out) < 20:
        out.extend(b.step()[2])
    assert_same_distributions(out, run(backend(), [prompt(12, 2)], 20, logprobs=ALL_LOGPROBS)[0])


def test_chunked_prefill_matches_one_chunk():
    prompts = [prompt(50, 5), prompt(23, 6)]
    whole = run(backend(chunk_size=4096), prompts, 25, logprobs=ALL_LOGPROBS)
    chunked = run(backend(chunk_size=7), prompts, 25, logprobs=ALL_LOGPROBS)
    for seq_id in whole:
        assert_same_distributions(whole[seq_id], chunked[seq_id])


def test_long_prompt_produces_its_first_token_in_the_step_that_finishes_it():
    b = backend(chunk_size=7)
    b.add(0, prompt(20, 7), GREEDY)
    assert [b.step(), b.step()] == [{}, {}]  # 7 + 7 tokens
    assert list(b.step()) == [0]  # the last 6
    assert b.stats()["prefill_tokens"] == 20


def test_prefill_budget_is_shared_across_sequences():
    b = backend(chunk_size=10)
    b.add(0, prompt(6, 1), GREEDY)
    b.add(1, prompt(6, 2), GREEDY)
    assert list(b.step()) == [0]  # 6 tokens of sequence 0, 4 of sequence 1
    assert b.stats()["prefill_tokens"] == 10
    assert sorted(b.step()) == [0, 1]


def test_score_agrees_with_the_logprobs_of_generated_tokens():
    request = LogprobRequest(top_n=5, token_ids=(3, 256))
    p = prompt(30, 8)
    generated = run(backend(), [p], 20, logprobs=request)[0]
    chunks = list(backend(chunk_size=16).score(p + ids(generated), len(p), request))
    assert chunks[:-1] == [None] * 4  # 49 positions forwarded (the last token predicts nothing), 16 at a time
    scored = chunks[-1]
    assert len(scored) == 20
    for s, g in zip(scored, generated):
        assert s.logprob == pytest.approx(g.logprobs.logprob, abs=1e-4)
        assert [i for i, _ in s.top] == [i for i, _ in g.logprobs.top]
        assert dict(s.top) == pytest.approx(dict(g.logprobs.top), abs=1e-4)
        assert dict(s.requested) == pytest.approx(dict(g.logprobs.requested), abs=1e-4)


def test_score_from_position_zero_starts_with_none():
    *_, scored = backend().score(prompt(12, 10), 0, LogprobRequest())
    assert scored[0] is None and len(scored) == 12


def test_score_leaves_running_sequences_alone():
    b = backend()
    b.add(0, prompt(10, 9), GREEDY, ALL_LOGPROBS)
    out = b.step()[0]
    list(b.score(prompt(30, 10), 0, LogprobRequest()))
    while len(out) < 10:
        out.extend(b.step()[0])
    assert_same_distributions(out, run(backend(), [prompt(10, 9)], 10, logprobs=ALL_LOGPROBS)[0])


def test_score_refuses_a_bad_start_at_the_call():
    with pytest.raises(ValueError, match="start 5"):
        backend().score([1, 2, 3], 5, LogprobRequest())


def test_remove_frees_the_sequence_and_its_cache():
    b = backend()
    run(b, [prompt(40, 11)], 3)
    assert b.stats()["active_sequences"] == 1
    b.remove(0)
    b.remove(0)  # unknown ids are ignored
    assert b.stats()["active_sequences"] == 0
    assert b._pool.capacity == 0  # the last sequence out gives the memory back
    assert b.step() == {}
    b.add(0, prompt(5, 12), GREEDY)  # the id may be reused


def test_add_refuses_duplicates_a_full_batch_and_oversized_prompts():
    b = backend(context_length=64)
    b.add(1, [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already active"):
        b.add(1, [1, 2], GREEDY)
    for i in range(2, 9):
        b.add(i, [1], GREEDY)
    with pytest.raises(ValueError, match="full"):
        b.add(9, [1], GREEDY)
    b.remove(2)
    with pytest.raises(ValueError, match="64"):
        b.add(10, [1] * 64, GREEDY)
    with pytest.raises(ValueError, match="288"):
        b.add(10, [1, 288], GREEDY)


def test_stats_count_the_work():
    b = backend()
    run(b, [prompt(10, 1), prompt(4, 2)], 5)
    stats = b.stats()
    assert stats["prefill_tokens"] == 14
    assert stats["decode_tokens"] == 8  # the first token of each comes from prefill
    assert stats["steps"] == 5
    # Two MoE layers, 2 experts per token, every forwarded token routed once per layer.
    assert [sum(layer) for layer in stats["expert_selections"]] == [2 * 22, 2 * 22]


def test_kv_pool_grows_in_pages_up_to_the_context():
    pool = KVPool(TinyConfig(vocab_size=288), slots=2, max_tokens=1000)
    pool.reserve(10)
    assert pool.capacity == 256
    pool.reserve(300)
    assert pool.capacity == 512
    pool.reserve(700)
    assert pool.capacity == 1000
    with pytest.raises(ValueError, match="1001"):
        pool.reserve(1001)


def test_routing_bias_chooses_but_does_not_weigh():
    b = backend()
    moe = b.model.moe_layers[0]
    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(0))
    moe.e_score_correction_bias[5] = 100.0
    chosen, weights = moe.route(x)
    assert (chosen == 5).any(dim=-1).all()
    scores = torch.sigmoid(x @ moe.router.T).gather(1, chosen)
    assert torch.allclose(weights, 2.5 * scores / scores.sum(dim=-1, keepdim=True))
    assert torch.allclose(weights.sum(dim=-1), torch.full((100,), 2.5))


def test_swiglu_clamps_gate_from_above_and_up_both_ways():
    gate = torch.tensor([1000.0, -1000.0, 3.0, 1000.0])
    up = torch.tensor([1000.0, 1000.0, 3.0, -1000.0])
    expected = F.silu(torch.tensor([10.0, -1000.0, 3.0, 10.0])) * torch.tensor([10.0, 10.0, 3.0, -10.0])
    assert torch.equal(swiglu(gate, up, 10.0), expected)
    assert swiglu(gate[:1], up[:1], None).item() == pytest.approx(1e6)


def test_experts_stay_bounded_on_huge_inputs():
    moe = backend().model.moe_layers[1]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 1e4
    out = moe.experts(x)  # [E, N, hidden]
    gate, up = torch.einsum("nh,ehi->eni", x, moe.gate_up).chunk(2, dim=-1)
    bound = F.silu(torch.tensor(10.0)) * 10 * moe.down.abs().sum(dim=1).max()
    assert torch.isfinite(out).all() and out.abs().max() <= bound
    assert gate.max() > 10 and up.abs().max() > 10  # the clamp was needed


def test_sampled_text_looks_like_words():
    b = backend()
    chat = b.tokenizer.encode("[gMASK]<sop><|user|>Tell me a story.<|assistant|><think></think>")
    out = run(b, [chat], 300, SamplingParams(temperature=1.0, seed=1))[0]
    # the byte tokens spell the words; the special tokens among them (ends of text, of structures) are not text
    text = b.tokenizer.decode([t for t in ids(out) if t < 256])
    assert len(text) > 250
    letters_and_spaces = sum(c.isascii() and (c.isalpha() or c in " \n.,") for c in text)
    assert letters_and_spaces / len(text) > 0.9
    assert 0.05 < text.count(" ") / len(text) < 0.3


def test_an_agents_next_turn_prefills_only_what_it_added():
    """Turn two repeats turn one's prompt and answer and adds a message: it takes every token turn one fed from the
    prefix cache, reports them on its first token, and computes what a backend without the cache computes."""
    cached_backend, fresh = backend(chunk_size=64), backend(chunk_size=64)
    first_prompt = prompt(150, seed=1)
    answer = run(cached_backend, [first_prompt], 12)[0]
    cached_backend.remove(0)
    fed = first_prompt + ids(answer)[:-1]  # the last sampled token was never fed
    second_prompt = first_prompt + ids(answer) + prompt(40, seed=2)
    second = run(cached_backend, [second_prompt], 8, logprobs=ALL_LOGPROBS)[0]
    assert [t.cached_prompt_tokens for t in second] == [len(fed)] + [0] * 7
    assert cached_backend.stats()["prefill_tokens"] == len(first_prompt) + len(second_prompt) - len(fed)
    assert_same_distributions(second, run(fresh, [second_prompt], 8, logprobs=ALL_LOGPROBS)[0])


def test_a_cached_prefix_joins_a_batch_that_is_running():
    """The pool a running batch's forward made is written in inference mode (torch refuses otherwise)."""
    b = backend(chunk_size=64)
    first = prompt(80, seed=6)
    run(b, [first], 4)
    b.remove(0)
    b.add(1, prompt(30, seed=7), GREEDY)
    b.step()  # the running sequence's forward remakes the pool
    b.add(2, first + [5], GREEDY)
    produced = {}
    while 2 not in produced:
        produced.update(b.step())
    assert produced[2][0].cached_prompt_tokens == 80


def test_the_prefix_cache_keeps_its_token_budget_and_drops_covered_entries():
    b = TinyBackend(context_length=512, max_batch_size=2, chunk_size=512, prefix_cache_tokens=300)
    short = prompt(100, seed=3)
    for seq_id, p in enumerate([short, short + prompt(60, seed=4), prompt(200, seed=5)]):
        b.add(seq_id, p, GREEDY)
        while seq_id not in b.step():
            pass
        b.remove(seq_id)
    # the 100-token entry is a prefix of the 160-token one; the 200-token one pushes the 160 out of 300
    assert (b.stats()["prefix_cache_entries"], b.stats()["prefix_cache_tokens"]) == (1, 200)
    b.add(9, short + [1], GREEDY)
    assert b.step()[9][0].cached_prompt_tokens == 0
