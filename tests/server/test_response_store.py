"""The Responses stores: the in-memory one's bound, and the shared one against a real Redis server."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time

import pytest
import redis

from glm53.config import STORE_URL
from glm53.server.response_store import (
    KEY_PREFIX,
    SHARED_TTL_S,
    MemoryStore,
    SharedStore,
    StoreUnavailable,
    make_store,
)

from .servers import free_port

CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture(scope="module")
def redis_url():
    port = free_port()
    server = subprocess.Popen([shutil.which("valkey-server") or shutil.which("redis-server"), "--bind", "127.0.0.1", "--port", str(port),
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)  # polling its port: the server signals readiness no other way
    yield url
    server.terminate()
    server.wait()


def test_the_memory_store_drops_the_least_recently_used():
    store = MemoryStore(2)
    for rid in ("a", "b"):
        store.put(rid, CONVERSATION)
    assert store.conversation("a") == CONVERSATION  # a is now the most recently used
    store.put("c", CONVERSATION)
    assert (store.conversation("b"), len(store)) == (None, 2)
    assert "last 2 stored responses in memory" in store.describe()


def test_the_shared_store_keeps_conversations_for_thirty_days(redis_url):
    first, second = make_store(256, redis_url), make_store(256, redis_url)  # two replicas
    assert isinstance(first, SharedStore)
    first.put("resp_1", CONVERSATION)
    assert second.conversation("resp_1") == CONVERSATION and second.conversation("resp_2") is None
    ttl = redis.Redis.from_url(redis_url).ttl(KEY_PREFIX + "resp_1")
    assert SHARED_TTL_S - 60 < ttl <= SHARED_TTL_S


def test_a_store_that_does_not_answer_fails_reads_and_logs_writes(caplog):
    store = SharedStore(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(StoreUnavailable):
        store.conversation("resp_1")
    with caplog.at_level(logging.ERROR):
        store.put("resp_1", CONVERSATION)
    assert "resp_1 was not stored" in caplog.text


@pytest.mark.parametrize("text", ["redis://10.0.0.10:6379/0", "rediss://user:pw@store:6380", "unix:///run/valkey.sock"])
def test_store_urls(text):
    assert STORE_URL.parse(text) == text and STORE_URL.parse(" ") is None


@pytest.mark.parametrize("text", ["http://store:6379", "10.0.0.10:6379", "redis://"])
def test_bad_store_urls_are_refused(text):
    with pytest.raises(ValueError):
        STORE_URL.parse(text)
