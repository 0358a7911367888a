"""Server-sent events framing (``data: <json>\\n\\n``, ``[DONE]``, keep-alive comments) and the stream headers."""

from __future__ import annotations

import json

from flask import Response

KEEPALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx and friends: do not buffer the stream
}


def frame(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def named_frame(event: str, obj: dict) -> str:
    """A typed event (``event:`` and ``data:`` lines), as the Anthropic and Responses APIs stream them."""
    return f"event: {event}\n" + frame(obj)


def stream_response(chunks) -> Response:
    """A streamed ``text/event-stream`` response; every chunk is written as soon as it is yielded."""
    return Response(_encoded(chunks), mimetype="text/event-stream", headers=HEADERS, direct_passthrough=True)


def _encoded(chunks):
    # direct_passthrough hands our iterable to the WSGI server unchanged, so it must yield bytes; closing it
    # (client gone) must reach the inner generator at once, whose finally cancels the jobs
    try:
        for chunk in chunks:
            yield chunk.encode()
    finally:
        chunks.close()
