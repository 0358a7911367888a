"""Shared pieces of response bodies: the usage block and its cached prompt tokens."""

from __future__ import annotations

from glm53.engine.interface import Finish
from glm53.server.responses import cached_prompt_tokens, usage


def test_usage_reports_cached_prompt_tokens():
    assert usage(40, 5, 32) == {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45, "prompt_tokens_details": {"cached_tokens": 32}}


def test_each_prompt_counts_the_cached_tokens_of_its_least_cached_sample():
    def done(cached: int) -> Finish:
        return Finish("stop", 600, 3, cached_tokens=cached)

    # two prompts, two samples each: the first prompt was prefilled once (0) and reused (512) -> 0; the second
    # came from the cache for both samples
    assert cached_prompt_tokens([done(0), done(512), done(256), done(256)], 2) == 256
    assert cached_prompt_tokens([done(512)], 1) == 512
