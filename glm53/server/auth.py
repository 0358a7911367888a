"""Optional API key: ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as Anthropic's clients send it) on
every endpoint but ``/health`` and the built-in page (``/`` and its assets, ``server/web``: they hold nothing of the
model, and the page asks for the key itself).

The comparison takes constant time: both sides are hashed first, so not even the key's length shows in the
timing (``hmac.compare_digest`` is constant-time only for inputs of equal length). Neither the key nor the
presented value is ever logged (the access log carries no headers).
"""

from __future__ import annotations

import hashlib
import hmac

from flask import Flask, request

from .errors import APIError, json_error

OPEN_PATHS = frozenset({"/health"})
OPEN_BLUEPRINTS = frozenset({"web"})


def init_app(app: Flask, api_key: str | None) -> None:
    if not api_key:
        return
    expected = hashlib.sha256(api_key.encode()).digest()

    @app.before_request
    def _require_key():
        if request.path in OPEN_PATHS or request.blueprint in OPEN_BLUEPRINTS:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if "x-api-key" in request.headers:
            scheme, presented = "bearer", request.headers["x-api-key"]
        # WSGI hands header bytes over as latin-1 text: encoding back gives the bytes the client sent
        digest = hashlib.sha256(presented.strip().encode("latin-1")).digest()
        ok = hmac.compare_digest(digest, expected) and scheme.lower() == "bearer"
        if not ok:
            err = APIError(401, "a valid API key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return json_error(err)
        return None
