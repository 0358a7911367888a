"""Optional API key: ``Authorization: Bearer <key>`` on every endpoint but ``/health``.

The comparison takes constant time, and neither the key nor the presented value is ever logged.
"""

from __future__ import annotations

import hmac

from flask import Flask, request

from .errors import APIError, json_error

OPEN_PATHS = frozenset({"/health"})


def init_app(app: Flask, api_key: str | None) -> None:
    if not api_key:
        return
    expected = api_key.encode()

    @app.before_request
    def _require_key():
        if request.path in OPEN_PATHS:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), expected)
        if not ok:
            err = APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return json_error(err)
        return None
