"""One access-log line per request (logger ``glm53.access``), written once its response has been sent, so a
stream is logged at its end with its real token counts and duration.

    POST /v1/chat/completions 200 prompt_tokens=35 completion_tokens=21 ttft_ms=4.1 total_ms=88.0 finish=stop

The line carries no prompt or completion text unless ``GLM53_LOG_PROMPTS`` asks for it: prompts are the
users' data, and logs are kept longer and read by more people than responses. Headers are never logged (the
API key travels in one).

The same moment counts the request in the metrics, with the status it really ended with: a client that went away
(noticed while its job ran, or because the server could not send it everything) is 499, nginx's "client closed
request", whatever the response would have said; 5xx counts only the server's own faults. Probes (``/health``,
``/metrics``, ``/stats``) are logged at DEBUG: polled several times a second, at INFO they would bury the requests.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flask import request

# Named for what it logs rather than for this module, as gunicorn.access is: operators filter on the documented name
log = logging.getLogger("glm53.access")

ENVIRON_KEY = "glm53.access"
CLIENT_CLOSED = 499


@dataclass
class RequestRecord:
    """What a request's handlers add to its line (the generating endpoints, through ``JobGroup``)."""

    with_text: bool  # GLM53_LOG_PROMPTS: keep the texts below
    endpoint: str = "unmatched"  # the URL rule that served it, the metrics' label
    client_gone: bool = False  # the client went away before the response was sent
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_s: float | None = None
    finishes: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    completions: dict[int, list[str]] = field(default_factory=dict)  # choice index -> text pieces

    def fields(self) -> str:
        """Token counts and time to first token; empty for a request that ran no job."""
        if not (self.prompt_tokens or self.finishes):
            return ""
        out = [f"prompt_tokens={self.prompt_tokens}", f"completion_tokens={self.completion_tokens}"]
        if self.first_token_s is not None:
            out.append(f"ttft_ms={1000 * self.first_token_s:.1f}")
        return " ".join(out)

    def texts(self) -> str:
        completions = ["".join(self.completions[i]) for i in sorted(self.completions)]
        return f"prompts={json.dumps(self.prompts, ensure_ascii=False)} completions={json.dumps(completions, ensure_ascii=False)}"


def current_record() -> RequestRecord | None:
    """The record of the request being handled (None outside the access-logged app, as in unit tests)."""
    return request.environ.get(ENVIRON_KEY)


# logged at DEBUG; the built-in page's dashboard polls /health and /stats every second
PROBE_PATHS = frozenset({"/health", "/metrics", "/stats"})


class AccessLog:
    """WSGI middleware: gives each request a :class:`RequestRecord`, and when the response is closed logs it and
    passes ``(endpoint, status)`` to ``count``."""

    def __init__(self, app, with_text: bool, count: Callable[[str, int], None]):
        self.app = app
        self.with_text = with_text
        self.count = count

    def __call__(self, environ, start_response):
        t0 = time.monotonic()
        record = environ[ENVIRON_KEY] = RequestRecord(self.with_text)
        status = []

        def _start_response(status_line, headers, exc_info=None):
            status[:] = [status_line.split(" ", 1)[0]]
            return start_response(status_line, headers, exc_info)

        def _done(sent_all: bool):
            record.client_gone = record.client_gone or not sent_all
            code = str(CLIENT_CLOSED) if record.client_gone else (status[0] if status else "-")
            if code.isdigit():
                self.count(record.endpoint, int(code))
            parts = [environ.get("REQUEST_METHOD", "-"), environ.get("PATH_INFO", "-"), code, record.fields()]
            line = " ".join(p for p in parts if p) + f" total_ms={1000 * (time.monotonic() - t0):.1f}"
            if record.finishes:
                line += " finish=" + ",".join(record.finishes)
            if self.with_text and (record.prompts or record.completions):
                line += " " + record.texts()
            # probes (load balancers, the wait for a loading model, scrapers) poll several times a second: their
            # lines at DEBUG, their counts in the metrics as every request's
            log.log(logging.DEBUG if environ.get("PATH_INFO") in PROBE_PATHS else logging.INFO, "%s", line)

        return _ClosingIterable(self.app(environ, _start_response), _done)


class _ClosingIterable:
    """The app's response iterable, with a callback once the server has closed it: ``on_close(sent_all)``, false
    when the server stopped before the end (it closes early only when a write to the client failed)."""

    def __init__(self, inner: Iterable[bytes], on_close: Callable[[bool], None]):
        self._inner = inner
        self._on_close = on_close
        self._items = None
        self._sent_all = False

    def __iter__(self):
        self._items = iter(self._inner)
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._items)
        except StopIteration:
            self._sent_all = True
            raise

    def close(self) -> None:
        try:
            if hasattr(self._inner, "close"):
                self._inner.close()
        finally:
            self._on_close(self._sent_all)
