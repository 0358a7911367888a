"""Pieces of response bodies that every OpenAI-style endpoint shares."""

from __future__ import annotations

from ..engine.scheduler import Finish
from .errors import APIError


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


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
