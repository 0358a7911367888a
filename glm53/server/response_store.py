"""The Responses API's stored responses (``store``, ``previous_response_id``): a bounded in-memory store.

Each stored response keeps its whole conversation as chat messages (the earlier turns it continued, its own input
and its output), so a request naming it as ``previous_response_id`` continues that conversation. The least
recently used response is dropped past ``capacity`` (``GLM53_RESPONSES_STORE``). One gevent worker serves every
request from one OS thread, so no locking is needed.
"""

from __future__ import annotations

from collections import OrderedDict


class ResponseStore:
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
        """The stored conversation (a copy of the list), or None when unknown or dropped."""
        found = self._conversations.get(response_id)
        if found is None:
            return None
        self._conversations.move_to_end(response_id)
        return list(found)

    def __len__(self) -> int:
        return len(self._conversations)
