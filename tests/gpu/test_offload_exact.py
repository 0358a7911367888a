"""Exact mode against stock exllamav3 with everything in VRAM, on the same checkpoint, in one process.

The offload layer only changes where expert bytes are read from (host store over PCIe, a VRAM slot, a staging
buffer), never the arithmetic: teacher-forced prefill logits and greedy decode (tokens and log-probabilities)
must be bit-identical at every cache size, with staging on and off, and across an elastic loan and return.

Checkpoints: the tiny synthetic one always; the layer-scaled real-shape one (12 MoE layers x 288 experts, 36 GB)
too when ``SCALED_CHECKPOINT`` names it (``glm53 synth --preset scaled --seed 1 --out DIR``; about 3 minutes more).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from glm53 import config
from glm53.engine.interface import LogprobRequest, SamplingParams, SequenceFailure
from glm53.engine.sampling import logprobs_for

CACHE_TOKENS = 16384
CHUNK = 2048
DECODE = 32
GEN = torch.Generator().manual_seed(5)
# chat-shaped prompts; the 700-token one is a prefill large enough to be staged (>= STAGE_MIN_ROWS rows)
PROMPTS = [[154822, 154824, 154827] + torch.randint(300, 150000, (n,), generator=GEN).tolist() + [154828, 154841] for n in (7, 120, 700, 60)]
REQUEST = LogprobRequest(top_n=5, token_ids=(154820, 300))

CASES = {
    # name: extra settings
    "cache-0": ["--ec-cache-experts", "0"],
    "cache-11pct": ["--ec-cache-experts", "11%"],
    "cache-50pct": ["--ec-cache-experts", "50%"],
    "cache-100pct": ["--ec-cache-experts", "100%"],
    "cache-11pct-no-staging": ["--ec-cache-experts", "11%", "--ec-stage-gb", "0"],
    "cache-50pct-elastic": ["--ec-cache-experts", "50%", "--ec-elastic-gb", "0.05"],
    "cache-11pct-single-pass": ["--ec-cache-experts", "11%", "--prefill-last-page-split", "0"],
    # decode reads some misses from the prefetch pool instead (issue 20): the same bytes
    "cache-11pct-prefetch": ["--ec-cache-experts", "11%", "--prefetch", "1"],
    "cache-0-prefetch-wide": ["--ec-cache-experts", "0", "--prefetch", "1", "--prefetch-slots", "6", "--prefetch-extra", "2",
                              "--prefetch-lead", "1"],  # with the lead too (the first MoE layer's prefetch at a step's start)
    # a slower link emulated in band (issue 29): every transfer held for longer, the arithmetic untouched
    "cache-11pct-link-emulated": ["--ec-cache-experts", "11%", "--link-emulate-gbs", "10"],
    # host RAM for part of the experts (issue 32): a RAM tier of that share over the checkpoint's files, the rest read
    # from disk when picked; "again" is a restart with the same budget
    # prefill stages through the tier (its slots, and disk reads a layer ahead into its window) unless "unstaged" (no
    # staging buffers) or "small-stage" (a buffer smaller than a layer's disk reads: each layer reads at its routing)
    "cache-11pct-ram-half": ["--ec-cache-experts", "11%", "--host-ram-gb", "{ram 0.5}"],
    "cache-11pct-ram-half-again": ["--ec-cache-experts", "11%", "--host-ram-gb", "{ram 0.5}"],
    "cache-0-ram-window": ["--ec-cache-experts", "0", "--host-ram-gb", "{ram 0}"],  # one layer's window: every miss from disk
    "cache-11pct-ram-half-unstaged": ["--ec-cache-experts", "11%", "--host-ram-gb", "{ram 0.5}", "--ec-stage-gb", "0"],
    "cache-0-ram-half-small-stage": ["--ec-cache-experts", "0", "--host-ram-gb", "{ram 0.5}", "--ec-stage-gb", "{blocks 2}"],
    "cache-50pct-ram-half-elastic": ["--ec-cache-experts", "50%", "--host-ram-gb", "{ram 0.5}", "--ec-elastic-gb", "0.05"],
    # the next layer's likeliest experts read ahead into blocks of their own while a layer computes (its router's guess)
    "cache-11pct-ram-half-ahead": ["--ec-cache-experts", "11%", "--host-ram-gb", "{ram 0.5}", "--ram-tier-read-ahead", "2"],
    # the VRAM cache's evictions copied back into RAM slots (its steps predicted on the host), no disk read for them
    "cache-11pct-ram-half-write-back": ["--ec-cache-experts", "11%", "--host-ram-gb", "{ram 0.5}", "--ram-tier-write-back", "1"],
}


def _ram_gb(ckpt, share: float) -> str:
    """GLM53_HOST_RAM_GB for a RAM tier holding ``share`` of the checkpoint's experts (at least its window)."""
    from glm53.offload.host_store import HostStore

    store = HostStore.scan(ckpt)
    layer = store.num_experts * store.layout.block_bytes
    half_block = store.layout.block_bytes // 2  # so that rounding the figure cannot lose the last block
    return f"{(layer + share * (store.arena_bytes - layer) + half_block) / 1e9:.9f}"


def _blocks_gb(ckpt, blocks: int) -> str:
    """GLM53_EC_STAGE_GB for staging buffers of ``blocks`` experts."""
    from glm53.offload.host_store import HostStore

    return f"{blocks * HostStore.scan(ckpt).layout.block_bytes / 1e9:.9f}"


def _settings(ckpt, extra):
    templates = {"{ram ": lambda v: _ram_gb(ckpt, float(v)), "{blocks ": lambda v: _blocks_gb(ckpt, int(v))}
    extra = [next((f(a[len(t):-1]) for t, f in templates.items() if a.startswith(t)), a) for a in extra]
    return config.load(["--engine", "exl3", "--mode", "exact", "-m", str(ckpt), "-cs", str(CACHE_TOKENS), "--max-batch-size", "4",
                        "-ambs", "4", "-chunk_size", str(CHUNK), "--ec-elastic-gb", "0", *extra], {})


CHECKPOINTS = ["tiny"] + (["scaled"] if os.environ.get("SCALED_CHECKPOINT") else [])


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint if request.param == "tiny" else Path(os.environ["SCALED_CHECKPOINT"])


@pytest.fixture(scope="module")
def stock(checkpoint):
    """Stock exllamav3 with the experts in VRAM, and its answers for every prompt."""
    from glm53.engine.exl3 import prefill
    from glm53.engine.exl3.stock import load_stock

    s = load_stock(checkpoint, cache_tokens=CACHE_TOKENS, max_batch_size=4, chunk_size=CHUNK)
    answers = {"prefill": [_prefill_logits(s.model, p) for p in PROMPTS]}
    # decode under both prefill schedules: stock's (the prompt's last page in a forward of its own, exact mode's
    # default) and the single pass (fast mode's default); the engine must match stock running the same schedule.
    # A fresh generator for each: the engine's page table starts empty, so must stock's (a prompt seen before
    # resumes from its stashed recurrent state, which would give the single pass stock's split)
    for split in (True, False):
        gen = s.generator(max_batch_size=4)
        prefill.set_single_pass_prefill(gen, not split)
        answers[split] = {"single": [_stock_decode(gen, [p], s.vocab_size)[0] for p in PROMPTS],
                          "batch4": _stock_decode(gen, PROMPTS, s.vocab_size)}
        gen.close()
    yield answers
    s.close()
    torch.cuda.empty_cache()


def _prefill_logits(model, prompt):
    with torch.inference_mode():
        return model.forward(torch.tensor([prompt]), {"attn_mode": "flash_attn_nc"})[0].float().cpu()


def _stock_decode(gen, prompts, vocab):
    from glm53.engine.exl3.stock import greedy_job

    jobs = [greedy_job(p, DECODE, return_logits=True, decode_special_tokens=True, identifier=i) for i, p in enumerate(prompts)]
    for job in jobs:
        gen.enqueue(job)
    out = {i: ([], []) for i in range(len(prompts))}
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") == "streaming" and r.get("token_ids") is not None and r["token_ids"].numel():
                ids, logits = out[r["identifier"]]
                ids += r["token_ids"][0].tolist()
                logits.append(r["logits"][0])
    results = []
    for i in range(len(prompts)):
        ids, logits = out[i]
        rows = torch.cat(logits).float()[:, :vocab]
        results.append((ids, [logprobs_for(rows[j], ids[j], REQUEST) for j in range(len(ids))]))
    return results


def _engine_decode(backend, prompts):
    for i, p in enumerate(prompts):
        backend.add(i, p, SamplingParams(temperature=0.0), REQUEST)
    got = {i: [] for i in range(len(prompts))}
    for _ in range(8 * DECODE + 64):
        for seq, tokens in backend.step().items():
            assert not isinstance(tokens, SequenceFailure), f"sequence {seq} failed: {tokens.reason}"
            got[seq] += tokens
        if all(len(v) >= DECODE for v in got.values()):
            break
    for i in range(len(prompts)):
        backend.remove(i)
    return [([t.token_id for t in got[i][:DECODE]], [t.logprobs for t in got[i][:DECODE]]) for i in range(len(prompts))]


@pytest.mark.parametrize("case", list(CASES))
def test_exact_mode_is_bit_identical_to_stock(checkpoint, stock, case):
    from glm53.engine.exl3.backend import Exl3Backend
    from glm53.engine.exl3 import patches

    backend = Exl3Backend(_settings(checkpoint, CASES[case]))
    try:
        offload = backend.offload
        if "elastic" in case:
            # a card with no VRAM to spare: staging has only what the cache lends (an H200 always has room)
            offload._vram_headroom = lambda: offload.cache.elastic["lent_bytes"] if offload.cache.lent else 0
        for p, want in zip(PROMPTS, stock["prefill"]):
            got = _prefill_logits(backend.model, p)
            assert torch.equal(got, want), f"{case}: prefill logits differ for a {len(p)}-token prompt (max |d| {(got - want).abs().max():.3g})"
        split = "single-pass" not in case
        want = stock[split]
        forwards = []  # prompt tokens per forward of more than one token (prefill)
        count = patches.wrap_forward(patches.first_forward_module(backend.model),
                                        before=lambda x, p: forwards.append(x.shape[-1]) if x.shape[-1] > 1 else None)
        for i, p in enumerate(PROMPTS):
            forwards.clear()
            got = _engine_decode(backend, [p])[0]
            if i == 2:  # 705 tokens: stock prefills 512 + 192 (the last page on its own), one pass prefills 704
                assert forwards == ([512, 192] if split else [704]), f"{case}: prefill forwards {forwards}"
                count()
            assert got[0] == want["single"][i][0], f"{case}: greedy tokens differ for prompt {i}"
            assert got[1] == want["single"][i][1], f"{case}: log-probabilities differ for prompt {i}"
        got4 = _engine_decode(backend, PROMPTS)
        for i in range(len(PROMPTS)):
            assert got4[i][0] == want["batch4"][i][0], f"{case}: 4-stream greedy tokens differ for prompt {i}"
            assert got4[i][1] == want["batch4"][i][1], f"{case}: 4-stream log-probabilities differ for prompt {i}"

        assert offload.cache.verify() == []
        stats = offload.stats()
        cache = stats["cache"]
        assert cache["picks"] == cache["hits"] + cache["misses"] > 0
        total = cache["experts_total"]
        want_slots = {"cache-0": 0, "cache-100pct": total, "cache-50pct": round(total / 2)}.get(case.replace("-elastic", ""))
        if want_slots is not None:
            assert cache["slots"] == want_slots
        if case == "cache-0":
            assert cache["hits"] == 0
        if case == "cache-100pct":
            assert cache["hits"] == cache["picks"] and cache["admissions"] == 0
        if "ram-" in case:  # the RAM tier: experts came from its slots and from disk
            tier, staging = stats["ram_tier"], stats["staging"]
            assert tier["served"]["disk"] > 0 and tier["disk"]["failed"] == 0, tier
            assert tier["layers"]["decode_layers"] > 0 and tier["layers"]["other_layers"] > 0, tier  # short prefills too
            if "unstaged" in case:  # no buffers: every forward reads at each layer's routing
                assert staging["forwards"] == 0 and staging["tier_unstaged_forwards"] == 0, staging
            elif "small-stage" in case:  # buffers too small for a layer's disk reads: not staged, counted
                assert staging["forwards"] == 0 and staging["tier_unstaged_forwards"] > 0, staging
            else:  # the staged forwards' disk reads went through the feed
                assert staging["forwards"] > 0 and staging["disk_experts"] > 0 and staging["tier_unstaged_forwards"] == 0, staging
            assert ("window" in case) == (tier["policy_slots"] == 0) and offload.part("ram_tier").tier.verify() == []
            assert stats["host_store"]["ram_tier"] and "cpu_tier" not in stats
        elif "no-staging" in case:
            assert stats["staging"]["forwards"] == 0
        elif cache["slots"] < total:
            assert stats["staging"]["forwards"] > 0 and stats["staging"]["staged_experts"] > 0
        if "prefetch" in case:
            pf = stats["prefetch"]
            assert pf["plans"] > 0 and pf["copied"] > 0 and pf["used"] + pf["wasted"] == pf["copied"], pf
        if "elastic" in case:
            el = cache["elastic"]
            assert el["enter"] > 0 and el["exit"] == el["enter"] and el["restored_experts"] > 0 and el["realloc_failures"] == 0
        print(f"{case}: hit rate {cache['hit_rate']} oracle {cache['oracle_hit_rate']} admissions {cache['admissions']} staging {stats['staging']}"
              f"{' prefetch ' + str({k: v for k, v in stats['prefetch'].items() if k != 'per_layer'}) if 'prefetch' in stats else ''}")
    finally:
        backend.close()
        torch.cuda.empty_cache()


def test_a_staging_buffer_that_cannot_be_allocated_is_counted_and_the_prefill_reads_zero_copy(checkpoint, stock, monkeypatch):
    """Fault injection: the allocator refuses the staging buffers; the forward still gives stock's logits."""
    from glm53.engine.exl3.backend import Exl3Backend

    backend = Exl3Backend(_settings(checkpoint, ["--ec-cache-experts", "11%"]))
    try:
        stager = backend.offload.stager

        def refuse():
            raise torch.OutOfMemoryError("injected")

        monkeypatch.setattr(stager, "_allocate", refuse)
        got = _prefill_logits(backend.model, PROMPTS[2])  # 705 tokens: a staged forward
        monkeypatch.undo()
        assert torch.equal(got, stock["prefill"][2])
        st = backend.offload.stats()["staging"]
        assert st["alloc_failures"] == 1 and st["forwards"] == 0
        got = _prefill_logits(backend.model, PROMPTS[2])  # the allocator works again: staged, still identical
        assert torch.equal(got, stock["prefill"][2]) and backend.offload.stats()["staging"]["forwards"] == 1
    finally:
        backend.close()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "unstaged"])
def test_a_disk_read_error_fails_its_request_alone_and_the_next_is_served_exactly(checkpoint, stock, staged):
    """Fault injection beside the RAM tier (issue 32): a read of an expert that only the disk holds fails twice (past
    the reader's one retry) in a prefill, staged (the feed's read, a layer ahead) or not (at the layer's routing). The
    request ends alone with the reader's sentence (the file, the offset); the next request, whose read succeeds, gets
    stock's tokens and log-probabilities, and neither tier holds bytes from the failed read."""
    import errno

    from glm53.engine.exl3.backend import Exl3Backend

    extra = CASES["cache-11pct-ram-half"] + ([] if staged else ["--ec-stage-gb", "0"])
    backend = Exl3Backend(_settings(checkpoint, extra))
    try:
        offload = backend.offload
        tier = offload.part("ram_tier").tier
        resident = offload.cache.resident()
        expert = next(e for e in range(tier.store.num_experts) if resident[0, e] < 0 and tier.policy.slot_of[0, e] < 0)
        path, at, n, _ = tier.store.block_sources(0, expert)[0]
        tier.reader.inject(tier.store.shard_files().index(path), at, errno.EIO, times=2)
        # every prompt's prefill picks nearly all of the first MoE layer's experts; the 705-token one is staged
        backend.add(0, PROMPTS[2], SamplingParams(temperature=0.0), REQUEST)
        failure = None
        for _ in range(16):
            out = backend.step().get(0)
            if isinstance(out, SequenceFailure):
                failure = out
                break
        backend.remove(0)
        assert failure is not None, "the request did not fail"
        assert "EIO" in failure.reason and str(path) in failure.reason and str(at) in failure.reason, failure.reason
        assert tier.verify() == [] and offload.cache.verify() == []
        got = _engine_decode(backend, [PROMPTS[2]])[0]
        want = stock[True]["single"][2]
        assert got[0] == want[0] and got[1] == want[1], "the request after the failed read differs from stock"
        assert tier.reader.counters()["failed"] >= 1
    finally:
        backend.close()
        torch.cuda.empty_cache()
