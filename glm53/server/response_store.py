"""The Responses API's stored responses (``store``, ``previous_response_id``).

Each stored response keeps its whole conversation as chat messages (the earlier turns it continued, its own input
and its output), so a request naming it as ``previous_response_id`` continues that conversation.

Two stores, one interface: a bounded in-memory store for one box (the least recently used response is dropped past
``GLM53_RESPONSES_STORE``), and a Redis or Valkey server shared by every replica behind a router
(``GLM53_RESPONSES_STORE_URL``), so a conversation continues whichever replica the router picks, and survives the
replica that stored it restarting. One gevent worker serves every request from one OS thread, so the memory store
needs no locking; the Redis client's sockets are gevent's (gunicorn's worker patches them), so a read waits as a
greenlet, not as the thread.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Protocol

log = logging.getLogger(__name__)

# OpenAI keeps stored responses for 30 days; a shared store does the same, so it never needs a sweep.
SHARED_TTL_S = 30 * 24 * 3600
KEY_PREFIX = "glm53:response:"


class StoreUnavailable(Exception):
    """The shared store could not be read (the request gets 503: it may be retried)."""


class ResponseStore(Protocol):
    def put(self, response_id: str, conversation: list[dict]) -> None: ...

    def conversation(self, response_id: str) -> list[dict] | None:
        """The stored conversation (a copy), or None when unknown or dropped. :raise StoreUnavailable:"""

    def describe(self) -> str:
        """What it keeps, for the error that names a response it does not have."""


class MemoryStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._conversations: OrderedDict[str, list[dict]] = OrderedDict()

    def put(self, response_id: str, conversation: list[dict]) -> None:
        if self.capacity <= 0:
            return
        self._conversations[response_id] = conversation
        self._conversations.move_to_end(response_id)
        while len(self._conversations) > self.capacity:
            self._conversations.popitem(last=False)

    def conversation(self, response_id: str) -> list[dict] | None:
        found = self._conversations.get(response_id)
        if found is None:
            return None
        self._conversations.move_to_end(response_id)
        return list(found)

    def describe(self) -> str:
        return f"this server keeps the last {self.capacity} stored responses in memory"

    def __len__(self) -> int:
        return len(self._conversations)


class SharedStore:
    """Conversations as JSON under ``glm53:response:<id>`` in Redis or Valkey, each expiring after 30 days."""

    def __init__(self, url: str):
        try:
            import redis
        except ImportError as e:
            raise RuntimeError("GLM53_RESPONSES_STORE_URL needs the redis client: pip install 'glm53[fleet]'") from e
        self._errors = (redis.RedisError, OSError)
        # Short timeouts: a store that does not answer must not hold a request for longer than a retry would take.
        self._client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)

    def put(self, response_id: str, conversation: list[dict]) -> None:
        """Store, or log why not: the answer has been generated and is the client's whatever the store does."""
        try:
            self._client.set(KEY_PREFIX + response_id, json.dumps(conversation), ex=SHARED_TTL_S)
        except self._errors as e:
            log.error("responses store: %s was not stored: %s", response_id, e)

    def conversation(self, response_id: str) -> list[dict] | None:
        try:
            found = self._client.get(KEY_PREFIX + response_id)
        except self._errors as e:
            raise StoreUnavailable(str(e)) from e
        return None if found is None else json.loads(found)

    def describe(self) -> str:
        return "the shared store keeps stored responses for 30 days"


def make_store(capacity: int, url: str | None) -> ResponseStore:
    return SharedStore(url) if url else MemoryStore(capacity)
