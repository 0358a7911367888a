"""Constrained decoding end to end on the CPU demo model: the shared suite, generated schemas, reasoning before
the answer, and a batch that mixes constrained and free sequences."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .schema_gen import schemas
from .servers import Server
from .structured_suite import *  # noqa: F403 - the shared tests run against this module's fixtures
from .structured_suite import NO_THINK, USER, City, chat


@pytest.fixture(scope="module")
def server():
    s = Server(["serve", "--engine", "tiny", "--max-batch-size", "8", "-cs", "8192"]).wait_ready()
    yield s
    s.stop()


@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(schemas(), st.booleans(), st.integers(0, 2**16))
def test_generated_schemas_are_followed_streamed_and_not(client, schema, stream, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "generated", "schema": schema}}
    for choice in chat(client, stream, seed=seed, response_format=fmt, extra_body=NO_THINK):
        assert choice["finish"] == "stop", choice
        jsonschema.validate(json.loads(choice["content"]), schema)


def test_the_think_block_stays_free_and_the_answer_follows_it(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=USER, max_tokens=3000, seed=4, n=2,
                                       response_format={"type": "json_object"})
    for c in r.choices:
        assert c.finish_reason == "stop" and c.message.reasoning_content and isinstance(json.loads(c.message.content), dict)
    parsed = client.chat.completions.parse(model="glm-5.3-flash", messages=USER, response_format=City, max_tokens=3000, seed=4)
    assert parsed.choices[0].message.reasoning_content and isinstance(parsed.choices[0].message.parsed, City)


def test_free_sequences_beside_constrained_ones_are_unchanged(client):
    """A seeded free completion is the same alone and in a batch with constrained ones (masks touch their rows only)."""
    def free():
        r = client.chat.completions.create(model="glm-5.3-flash", messages=USER, max_tokens=120, seed=21, extra_body=NO_THINK)
        return r.choices[0].message.content

    alone = free()
    fmt = {"type": "json_object"}
    busy = [threading.Thread(target=chat, args=(client, False), kwargs={"n": 3, "seed": i, "response_format": fmt, "extra_body": NO_THINK})
            for i in range(3)]
    for t in busy:
        t.start()
    beside = free()
    for t in busy:
        t.join()
    assert beside == alone
