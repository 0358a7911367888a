"""Pieces of response bodies that every OpenAI-style endpoint shares."""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.interface import Finish
from .errors import APIError


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage block; ``cached_tokens`` are the prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_prompt_tokens(finishes: Sequence[Finish], n: int) -> int:
    """Cached tokens of a request whose choice ``p * n + c`` is the c-th sample of prompt p.

    ``usage.prompt_tokens`` counts each prompt once, so each prompt counts the cached tokens of its least-cached
    sample: the tokens that none of its samples had to prefill.
    """
    return sum(min(f.cached_tokens for f in finishes[p : p + n]) for p in range(0, len(finishes), n))


def finish_reason(finish: Finish, called_tools: bool = False) -> str:
    """OpenAI's finish_reason: a completion that ended normally after a tool call reports ``tool_calls``."""
    if finish.reason == "stop" and called_tools:
        return "tool_calls"
    return finish.reason


def engine_failure(finish: Finish) -> APIError:
    """The error for a job that did not complete: an engine fault (500) or the server shutting down (503)."""
    if finish.reason == "cancelled":
        return APIError(503, f"the request was cancelled: {finish.error or 'the client went away'}", code="cancelled")
    return APIError(500, f"the engine failed while generating: {finish.error}", code="engine_error")
