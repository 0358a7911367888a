"""OpenAI's chat ``logprobs`` object from the engine's per-token log-probabilities.

``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}``,
one entry per generated token in order: reasoning, tool-call markup and the final EOS token included, as vLLM and
SGLang report them (the engine does not know which text the output parser will call reasoning). ``bytes`` are the
token's own bytes; ``token`` is their text, with the bytes of a token that splits a UTF-8 character written as
``\\xNN`` escapes, as OpenAI does. Log-probabilities are natural logs of the full-vocabulary softmax of the raw
logits (before temperature, penalties and bias), the same as ``/generate`` reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..engine.interface import TokenLogprobs, Tokenizer

# JSON has no -Infinity: a token the model gives no chance at all is reported at OpenAI's floor
FLOOR = -9999.0


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprobs]) -> dict:
    """The ``logprobs`` of a choice (or of one chunk of a stream) for the tokens ``token_ids``."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        top = [_token(tokenizer, t, lp) for t, lp in entry.top]
        content.append({**_token(tokenizer, token_id, entry.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def _token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="backslashreplace"), "logprob": logprob if math.isfinite(logprob) else FLOOR,
            "bytes": list(raw)}
