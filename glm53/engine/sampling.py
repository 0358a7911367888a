"""Token sampling and log-probabilities for a batch of rows, independent of the backend that made the logits.

Each row has its own ``SamplingParams`` and its own random generator. A sampled row draws exactly one
uniform number from its generator per token (greedy rows draw none), so a seeded sequence produces the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from glm53.engine.interface import LogprobRequest, SamplingParams, TokenLogprobs


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """Pick the next token of every row.

    :param logits: [B, V] float32 raw logits; not modified.
    :param params: one per row.
    :param generators: one per row; None draws from torch's global generator (not reproducible).
    :param histories: one per row: [V] counts of each token generated so far, used by the presence and
        frequency penalties; None for a row without penalties.
    :return: [B] int64 token ids.
    """
    logits = _penalised(logits, params, histories)
    _add_bias(logits, params)
    chosen = logits.argmax(dim=-1)  # [B]; argmax returns the first maximum, so ties go to the lower id
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        chosen[rows] = _draw(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
    return chosen


def _penalised(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """A copy of ``logits`` [B, V] with presence and frequency penalties subtracted."""
    logits = logits.clone()
    rows = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and histories[i] is not None]
    if not rows:
        return logits
    counts = torch.stack([histories[i] for i in rows]).to(logits.dtype)  # [R, V]
    presence = logits.new_tensor([params[i].presence_penalty for i in rows])[:, None]  # [R, 1]
    frequency = logits.new_tensor([params[i].frequency_penalty for i in rows])[:, None]  # [R, 1]
    logits[rows] -= presence * (counts > 0) + frequency * counts
    return logits


def _add_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add every row's ``logit_bias`` to ``logits`` [B, V] in place, in one scatter."""
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if not entries:
        return
    rows, tokens, biases = zip(*entries)
    index = (torch.tensor(rows), torch.tensor(tokens))
    logits.index_put_(index, logits.new_tensor(biases), accumulate=True)


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row of ``logits`` [R, V] after temperature, top-k, top-p and min-p."""
    # A temperature below the dtype's smallest normal (a request may ask for 1e-300) would overflow the division
    # into NaN; with the row's maximum taken off first, it gives a one-hot on the argmax, as it should.
    temperature = logits.new_tensor([p.temperature for p in params])[:, None].clamp_min(torch.finfo(logits.dtype).tiny)  # [R, 1]
    shifted = logits - logits.max(dim=-1, keepdim=True).values  # [R, V]
    probs = torch.softmax(shifted / temperature, dim=-1)  # [R, V]
    # Stable descending sort: equal probabilities keep id order, so a one-token cut-off keeps what argmax picks.
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [R, V] each
    kept = _kept(sorted_probs, params)  # [R, V] bool, a prefix of each row
    cdf = (sorted_probs * kept).cumsum(dim=-1)  # [R, V]
    # Inverse-CDF sampling with one uniform per row, drawn from that row's own generator.
    uniform = logits.new_tensor([float(torch.rand(1, generator=g)) for g in generators])  # [R]
    target = (uniform * cdf[:, -1])[:, None]  # [R, 1]
    # right=True skips tokens whose probability is zero; the clamp guards u * total rounding up to total.
    rank = torch.searchsorted(cdf, target, right=True)  # [R, 1]
    rank = torch.minimum(rank, kept.sum(dim=-1, keepdim=True) - 1)
    return order.gather(1, rank).squeeze(1)  # [R]


def _kept(sorted_probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Which of the descending-sorted tokens [R, V] survive top-k, then top-p, then min-p."""
    vocab = sorted_probs.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]  # [R, 1]
    kept = torch.arange(vocab)[None, :] < top_k  # [R, V]
    # top-p works on the distribution renormalised over the top-k survivors: a token stays while the mass
    # of the better tokens before it is still short of top_p.
    masked = sorted_probs * kept
    mass_before = (masked.cumsum(dim=-1) - masked) / masked.sum(dim=-1, keepdim=True)  # [R, V]
    top_p = sorted_probs.new_tensor([p.top_p for p in params])[:, None]  # [R, 1]
    kept &= mass_before < top_p
    min_p = sorted_probs.new_tensor([p.min_p for p in params])[:, None]  # [R, 1]
    kept &= sorted_probs >= min_p * sorted_probs[:, :1]
    kept[:, 0] = True  # the most likely token always survives, whatever the settings
    return kept


def logprobs_for(
    logits: torch.Tensor, chosen: int | Sequence[int], request: LogprobRequest
) -> TokenLogprobs | list[TokenLogprobs]:
    """Log-probabilities from the raw logits (before temperature, penalties and bias).

    :param logits: [V] for one position, or [N, V] for N positions.
    :param chosen: the token at each position: an int for [V], a sequence of N ints for [N, V].
    :return: one ``TokenLogprobs`` for [V], a list of N for [N, V]. ``top`` is best first, equal values
        ordered by lower id.
    """
    single = logits.dim() == 1
    rows = logits.reshape(-1, logits.shape[-1]).float()  # [N, V]
    logprobs = torch.log_softmax(rows, dim=-1)  # [N, V]
    chosen_ids = torch.tensor([chosen] if single else list(chosen), device=rows.device).reshape(-1, 1)  # [N, 1]
    own = logprobs.gather(1, chosen_ids).squeeze(1).tolist()
    top = _top(logprobs, request.top_n)
    requested = _requested(logprobs, request.token_ids)
    result = [TokenLogprobs(logprob=own[i], top=top[i], requested=requested[i]) for i in range(len(own))]
    return result[0] if single else result


def _top(logprobs: torch.Tensor, n: int) -> list[tuple[tuple[int, float], ...]]:
    """The ``n`` best (id, logprob) pairs of each row of ``logprobs`` [N, V]."""
    if n <= 0:
        return [()] * logprobs.shape[0]
    # A stable sort (rather than topk, whose order among equal values is unspecified) puts the lower id first.
    values, ids = logprobs.sort(dim=-1, descending=True, stable=True)  # [N, V] each
    values, ids = values[:, :n].tolist(), ids[:, :n].tolist()
    return [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(ids, values)]


def _requested(logprobs: torch.Tensor, token_ids: Sequence[int]) -> list[tuple[tuple[int, float], ...]]:
    """(id, logprob) for each of ``token_ids`` in each row of ``logprobs`` [N, V]."""
    if not token_ids:
        return [()] * logprobs.shape[0]
    values = logprobs[:, list(token_ids)].tolist()  # [N, len(token_ids)]
    return [tuple(zip(token_ids, row)) for row in values]
