"""Constrained decoding on the GPU engine: the shared suite (``tests/server/structured_suite.py``) against exllamav3,
whose filter threads compute each constrained sequence's mask while the forward runs.

Checkpoints: the tiny synthetic one always; the layer-scaled real-shape one too when ``SCALED_CHECKPOINT`` names
it (``glm53 synth --preset scaled --seed 1 --out DIR``). Both have random weights: every schema of the suite bounds
its strings and arrays, so that answers end whatever such a model draws. The suite validates answers with the
``jsonschema`` package, which the GPU kit must carry (its wheels: jsonschema, attrs, referencing,
jsonschema-specifications, rpds-py). The demo model's tests of answers after free reasoning and of ``json_object``
are not run here: a random-weight model almost never writes ``</think>`` or closes an unbounded key.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import jsonschema
import pytest

from tests.server.json_schemas import SCHEMAS
from tests.server.servers import Server
from tests.server.structured_suite import *  # noqa: F403 - the shared tests run against this module's fixtures
from tests.server.structured_suite import MAX_TOKENS, NO_THINK, USER


@pytest.mark.skip(reason="json_object leaves an object's keys unbounded: a random-weight model almost never closes a key")
def test_json_object_answers_are_objects():
    pass


CHECKPOINTS = ["tiny"] + (["scaled"] if os.environ.get("SCALED_CHECKPOINT") else [])


@pytest.fixture(scope="module", params=CHECKPOINTS)
def server(request, tiny_checkpoint):
    checkpoint = tiny_checkpoint if request.param == "tiny" else Path(os.environ["SCALED_CHECKPOINT"])
    s = Server(
        ["serve", "--engine", "exl3", "--mode", "exact", "-m", str(checkpoint), "-cs", "16384", "--max-batch-size", "4", "-ambs", "4",
         "-chunk_size", "2048", "--sse-keepalive-s", "0.2"]
    ).wait_ready(timeout=600)
    yield s
    s.stop()


def test_constrained_and_free_sequences_share_decode_steps(server, client):
    """Four JSON answers and four free ones at once: all complete, the free ones to their full length."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS["person"]}}
    results: dict[str, list] = {"held": [], "free": []}

    def held(i):
        r = client.chat.completions.create(model="glm-5.3-flash", messages=USER, max_tokens=MAX_TOKENS, seed=i,
                                           response_format=fmt, extra_body=NO_THINK)
        results["held"].append(r.choices[0])

    def free(i):
        r = client.chat.completions.create(model="glm-5.3-flash", messages=USER, max_tokens=64, seed=i,
                                           extra_body={**NO_THINK, "ignore_eos": True})
        results["free"].append(r)

    before = server.get("/stats")[1]["scheduler"]["steps"]
    threads = [threading.Thread(target=f, args=(i,)) for i in range(4) for f in (held, free)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results["held"]) == 4 and all(c.finish_reason == "stop" for c in results["held"])
    for c in results["held"]:
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["person"])
    assert len(results["free"]) == 4 and all(r.usage.completion_tokens == 64 for r in results["free"])
    assert server.get("/stats")[1]["scheduler"]["steps"] - before < 8 * 64  # they were batched, not run one by one
