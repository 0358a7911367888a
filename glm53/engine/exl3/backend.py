"""The GPU backend (``--engine exl3``): stock exllamav3's generator behind the ``Backend`` contract.

exllamav3 does the paging, chunked prefill, batched decode and sampling; the scheduler does stops and text. Jobs
carry no stop conditions and no length limit here: the scheduler removes a sequence when it has seen one, so both
backends stop in exactly the same way. Pages are reserved in rounds (``max_rq_tokens``) rather than for the
whole remaining context, so several jobs with uncapped ``max_tokens`` all start at once.

Only exllamav3's public API is used here (and a job's own prefix-cache counters, ``cached_prompt_tokens``): the
model is loaded by ``load`` with the offload started inside it (``offload.start_offload``), and reaching into
exllamav3's internals is ``patches``' and ``prefill``'s job.

An agent's turns share their prefix: each request is the last one plus the answer and what came after. The
generator keeps a recurrent-state checkpoint at every page boundary an answer passes and one at each prompt's
last page boundary (``prefill.set_prompt_end_checkpoints`` in single-pass prefill, stock's last-page split
otherwise), in host RAM bounded by ``GLM53_RECURRENT_CACHE_GB``, so the next turn prefills only from the last
page boundary that both requests share.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ...config import Settings
from ...models.checkpoint import CONFIG_FILE, GENERATION_CONFIG_FILE, read_config
from ...progress import Progress
from ..constraints import Constraint, Vocabulary
from ..gpu import device_facts
from ..interface import (
    LogprobRequest,
    ModelInfo,
    SampledToken,
    SamplingParams,
    SequenceFailure,
    TokenLogprobs,
)
from ..sampling import logprobs_for
from . import prefill, triton_pin
from .load import load, page_size
from .offload import start_offload
from .tokenizer import HFTokenizer

log = logging.getLogger(__name__)

# exllamav3 divides the logits by the temperature: far below this the quotient overflows to inf/NaN, while at it
# sampling is already argmax in practice (greedy with penalties or a bias also runs at it).
MIN_TEMPERATURE = 1e-4

# Pages a job reserves per round: a job past it requeues (keeping its pages through the prefix cache), so an
# uncapped job never holds the whole remaining context while others wait.
PAGE_ROUND_TOKENS = 2048


class Exl3Backend:
    def __init__(self, settings: Settings, extra_caches: int = 0, progress: Progress | None = None):
        """:param extra_caches: more caches of ``settings.cache_size`` tokens (one sequence each) for measurement
        tools that drive the model directly (``bench/decode_kl.py``), as ``self.extra_caches``.
        :param progress: where the load reports its phases (reading shards, pinning, loading the model, warming
            up, building the cache)."""
        progress = progress or Progress()
        t0 = time.monotonic()
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is available to this process; use --engine tiny or run on a CUDA host")
        # before the load: its warm-up already runs the KDA kernels whose autotuned picks the file fixes
        self.triton_pins = triton_pin.install(settings.triton_pin) if settings.triton_pin is not None else None
        # Routed experts live in pinned host memory and a VRAM cache (glm53/offload), never loaded into VRAM whole;
        # the extra caches exist before the load, which allocates every attached cache's tensors
        loaded = load(settings.model_dir, cache_tokens=settings.cache_size, cache_batch=[settings.ambs] + [1] * extra_caches,
                      chunk_size=settings.chunk_size, gpu_split=[settings.vram_limit_gb] if settings.vram_limit_gb else None,
                      offload=lambda model, load_model, warmup: start_offload(settings, model, load_model, warmup, progress),
                      progress=progress)
        self._config, self.model, self.offload = loaded.config, loaded.model, loaded.offload
        self.cache, self.extra_caches = loaded.caches[0], loaded.caches[1:]
        exl_tokenizer = loaded.tokenizer
        page = page_size()
        self.generator = loaded.generator(max_batch_size=settings.max_batch_size,
                                          **prefill.checkpoint_settings(settings.recurrent_cache_gb, page))
        prefill.set_single_pass_prefill(self.generator, not settings.prefill_last_page_split)
        # single-pass prefill skips stock's checkpoint at the prompt's last page: the recurrent layers can make it instead
        self.prompt_end = prefill.set_prompt_end_checkpoints(
            self.generator, settings.prompt_end_checkpoints and not settings.prefill_last_page_split)
        # a recurrent model decodes at most as many sequences as the cache has state slots (-ambs)
        self.max_batch_size = self.generator.max_batch_size
        self.chunk_size = settings.chunk_size
        self.tokenizer = HFTokenizer(exl_tokenizer.tokenizer, self._config.vocab_size)
        self._exl_tokenizer = exl_tokenizer
        self.info = ModelInfo(
            name=Path(settings.model_dir).name,
            architecture=self._config.architecture,
            context_length=settings.cache_size,
            vocab_size=self._config.vocab_size,
            eos_token_ids=frozenset(eos_token_ids(settings.model_dir, exl_tokenizer)),
            checkpoint_dir=settings.model_dir,
            facts={"load_seconds": round(time.monotonic() - t0, 2), "decode_slots": self.max_batch_size, **_memory_facts(),
                   "triton_pins": self._pins()},
            gpu=device_facts(torch.cuda.current_device()),
            max_score_tokens=settings.chunk_size,  # score() is one cache-less forward of at most a prefill chunk
        )
        self.vocabulary = Vocabulary.from_hf(exl_tokenizer.tokenizer, self._config.vocab_size, self.info.eos_token_ids)
        self._jobs: dict[int, LogprobRequest | None] = {}
        self._page_size = page
        self._prefilling: set[int] = set()  # sequences that have not had their first token yet
        self._counters = {"steps": 0, "decode_tokens": 0, "scored_tokens": 0, "requeues_seen": 0}

    def add(self, seq_id: int, prompt_ids: Sequence[int], sampling: SamplingParams, logprobs: LogprobRequest | None = None,
            constraint: Constraint | None = None) -> None:
        from exllamav3 import Job

        from .grammar_filter import GrammarFilter

        if seq_id in self._jobs:
            raise ValueError(f"sequence {seq_id} is already active")
        job = Job(
            input_ids=torch.tensor([list(prompt_ids)], dtype=torch.long),
            max_new_tokens=None,
            sampler=exl3_sampler(sampling),
            seed=sampling.seed,
            decode_special_tokens=True,
            return_logits=logprobs is not None,
            identifier=seq_id,
            max_rq_tokens=PAGE_ROUND_TOKENS,
            filters=[GrammarFilter(constraint, self._exl_tokenizer)] if constraint is not None else None,
        )
        self.generator.enqueue(job)
        self._jobs[seq_id] = logprobs
        self._prefilling.add(seq_id)

    def remove(self, seq_id: int) -> None:
        self._prefilling.discard(seq_id)
        if self._jobs.pop(seq_id, "absent") == "absent":
            return
        # a requeued job is a new Job object with the same identifier
        for job in self.generator.active_jobs + self.generator.pending_jobs:
            if job.identifier == seq_id:
                self.generator.cancel(job)

    def iterate(self) -> list[dict]:
        """One step of exllamav3's generator with the offload's per-step hooks around it (the CPU tier's worker woken
        before, its live costs refreshed after): what :meth:`step` runs, and what measurement tools that read the
        generator's results directly call instead of ``generator.iterate()``."""
        self.offload.before_step()
        results = self.generator.iterate()
        self.offload.after_step()
        return results

    def step(self) -> dict[int, list[SampledToken] | SequenceFailure]:
        out: dict[int, list[SampledToken] | SequenceFailure] = {}
        for r in self.iterate():
            if r.get("stage") == "error":
                # exllamav3 contained a failure to one job (reap_failed_job): that sequence ends alone
                seq_id = getattr(r.get("job"), "identifier", None)
                if seq_id in self._jobs:
                    err = r.get("error")
                    out[seq_id] = SequenceFailure(f"{type(err).__name__}: {err}")
                continue
            if r.get("stage") != "streaming" or r.get("token_ids") is None:
                continue
            seq_id = r["identifier"]
            ids = r["token_ids"][0].tolist()
            if not ids or seq_id not in self._jobs:
                continue
            request = self._jobs[seq_id]
            logits = r.get("logits") if request is not None else None
            cached = 0
            if seq_id in self._prefilling:
                self._prefilling.discard(seq_id)
                cached = cached_prompt_tokens(r["job"], self._page_size)
            out.setdefault(seq_id, []).extend(
                SampledToken(t, logprobs_for(logits[0, i].float(), t, request) if logits is not None else None, cached if i == 0 else 0)
                for i, t in enumerate(ids)
            )
            self._counters["decode_tokens"] += len(ids)
        self._counters["steps"] += 1
        return out

    def score(self, ids: Sequence[int], start: int, request: LogprobRequest) -> Iterator[list[TokenLogprobs | None] | None]:
        """One cache-less forward over ``ids``; the head runs only from position ``start - 1``.

        :raise ValueError: more than one prefill chunk of tokens (a longer forward would stall every other job).
        """
        if len(ids) > self.chunk_size:
            raise ValueError(f"teacher-forced scoring takes at most {self.chunk_size} tokens (the prefill chunk size); got {len(ids)}")
        first = max(start - 1, 0)
        with torch.inference_mode():
            logits = self.model.forward(torch.tensor([list(ids)], dtype=torch.long), {"attn_mode": "flash_attn_nc", "last_tokens_only": len(ids) - first})
        rows = logits[0, :, : self.info.vocab_size].float()  # [len(ids) - first, V]; row j predicts ids[first + j + 1]
        entries: list[TokenLogprobs | None] = []
        for p in range(start, len(ids)):
            entries.append(None if p == 0 else logprobs_for(rows[p - 1 - first], ids[p], request))
        self._counters["scored_tokens"] += len(ids)
        yield entries

    def stats(self) -> dict:
        return {
            **self._counters,
            "active_jobs": len(self.generator.active_jobs),
            "pending_jobs": len(self.generator.pending_jobs),
            **_memory_facts(),
            "recurrent_checkpoints": prefill.checkpoint_stats(self.generator, self.prompt_end),
            "offload": self.offload.stats(),
            "triton_pins": self._pins(),
        }

    def _pins(self) -> dict | None:
        """What ``GLM53_TRITON_PIN`` pinned so far: the file, its picks, keys answered from it and keys Triton tuned."""
        return self.triton_pins.as_dict() if self.triton_pins is not None else None

    def close(self) -> None:
        self.generator.close()
        self.offload.close()
        self.model.unload()
        if self.triton_pins is not None:
            triton_pin.uninstall()


def cached_prompt_tokens(job, page_size: int) -> int:
    """Prompt tokens of a single-sequence exllamav3 job whose keys and values it took from the page cache.

    exllamav3's own count, the one it reports as ``cached_tokens`` in a finished job's result (the scheduler
    removes jobs before they finish): whole pages found by hash when the job's pages were allocated, or filled
    by another job before its prefill reached them, plus the start of a partial page copied from a matching one
    (not on recurrent models such as GLM-5.3-Flash, whose reuse ends at the last page with a stashed recurrent
    state). Read at the job's first token, which always comes in its first round (before any requeue resets
    these counters).
    """
    return job.cached_pages * page_size + job.cached_tokens


def exl3_sampler(params: SamplingParams):
    """exllamav3's sampler for our sampling parameters (argmax for greedy, as stock exllamav3 does)."""
    from exllamav3 import ArgmaxSampler, ComboSampler

    if params.greedy and not params.logit_bias and not params.presence_penalty and not params.frequency_penalty:
        return ArgmaxSampler()
    return ComboSampler(
        temperature=max(params.temperature, MIN_TEMPERATURE),
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        pres_p=params.presence_penalty,
        freq_p=params.frequency_penalty,
        logit_bias=dict(params.logit_bias) or None,
    )


def eos_token_ids(model_dir: Path, exl_tokenizer) -> set[int]:
    """Union of the config's, generation_config's and the tokenizer's end-of-sequence ids."""
    ids: set[int] = set()
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        if (Path(model_dir) / name).is_file():
            data = read_config(model_dir, name)
            for value in (data.get("eos_token_id"), data.get("text_config", {}).get("eos_token_id")):
                if isinstance(value, int):
                    ids.add(value)
                elif isinstance(value, list):
                    ids.update(v for v in value if isinstance(v, int))
    if exl_tokenizer.eos_token_id is not None:
        ids.add(exl_tokenizer.eos_token_id)
    return ids


def _memory_facts() -> dict:
    return {
        "vram_allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 3),
        "vram_reserved_gb": round(torch.cuda.memory_reserved() / 1e9, 3),
    }
