"""Unknown top-level request fields: accepted (clients send many harmless extras), logged once per endpoint and
field name, counted per endpoint for ``/metrics``.

A client may invent a new name with every request (a fuzzer does), so the pairs remembered for logging are
capped and the metric is labelled by endpoint only: neither the log, nor the memory, nor the metric's series
grow with such names.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

MAX_LOGGED = 1000  # distinct (endpoint, field) pairs logged; past them, occurrences are only counted
METRIC = "glm53_ignored_request_fields_total"


class UnknownFields:
    def __init__(self, registry: CollectorRegistry):
        self._lock = threading.Lock()  # a greenlet lock under gevent; a real one under a threaded server
        self._logged: set[tuple[str, str]] = set()
        self._full = False
        self._count = Counter(METRIC, "Unknown top-level request fields that were ignored, by endpoint.", ["endpoint"],
                              registry=registry)

    def note(self, endpoint: str, names: Iterable[str]) -> None:
        """Count the unknown fields of one request body; log the (endpoint, field) pairs not seen before."""
        lines = []
        seen = 0
        with self._lock:
            for name in names:
                seen += 1
                if (endpoint, name) in self._logged or self._full:
                    continue
                if len(self._logged) >= MAX_LOGGED:
                    self._full = True
                    lines.append(f"more than {MAX_LOGGED} distinct unknown request fields: the others are counted in {METRIC}, not logged")
                    continue
                self._logged.add((endpoint, name))
                lines.append(f"ignoring unknown request field {name!r} on {endpoint} (logged once; counted in {METRIC})")
        if seen:
            self._count.labels(endpoint).inc(seen)
        for line in lines:
            log.info("%s", line)
