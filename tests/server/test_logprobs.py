"""The chat ``logprobs`` object (unit level; the e2e suites check it over HTTP with the openai client)."""

from __future__ import annotations

import json
import math

from glm53.engine.interface import TokenLogprobs
from glm53.server.logprobs import chat_logprobs
from tests.fakes import EOS, ByteTokens


def test_entries_in_order_with_escaped_split_bytes_and_a_floor_for_impossible_tokens():
    ids = list("é!".encode()) + [EOS]
    entries = [TokenLogprobs(-0.25, ((0xC3, -0.25), (0x41, -math.inf))), TokenLogprobs(-0.5), TokenLogprobs(-1.0), TokenLogprobs(-math.inf)]
    out = chat_logprobs(ByteTokens(), ids, entries)
    assert out["refusal"] is None
    assert [(e["token"], e["bytes"], e["logprob"]) for e in out["content"]] == [
        ("\\xc3", [0xC3], -0.25), ("\\xa9", [0xA9], -0.5), ("!", [0x21], -1.0), ("<eos>", list(b"<eos>"), -9999.0)]
    assert out["content"][0]["top_logprobs"] == [{"token": "\\xc3", "logprob": -0.25, "bytes": [0xC3]},
                                                 {"token": "A", "logprob": -9999.0, "bytes": [0x41]}]
    json.dumps(out, allow_nan=False)  # valid JSON: no -Infinity
