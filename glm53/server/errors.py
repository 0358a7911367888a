"""One error shape for every endpoint: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's).

Handlers raise :class:`APIError` (or let pydantic's ValidationError through); :func:`init_app` maps every
exception to that shape with the right status. Anything unexpected becomes a 500 with a sanitised message and a
logged traceback; bad input must never get there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from flask import Flask, Response, current_app, has_request_context, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)

# A client that sends its whole body before reading the answer (urllib, requests) sees a connection reset instead
# of the 413 when the server closes with the body unread; up to this many bytes are read and dropped first.
DISCARD_LIMIT = 64 * 2**20

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


class FieldError(ValueError):
    """Raised by a request model's cross-field rule: the message is about ``param``, a field path relative to
    the model (pydantic puts model-level errors at the model itself, which would leave ``param`` empty)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "literal"})


def _field_path(loc: tuple) -> list[str]:
    """A pydantic error location without the union-member tags it inserts (``constrained-str``,
    ``list[str]``, ``ContentPart``): what is left are field names, dict keys and list indexes."""
    out = []
    for part in loc:
        text = str(part)
        if isinstance(part, str) and (text in _TYPE_TAGS or text[:1].isupper() or any(c in text for c in "[-(")):
            continue
        out.append(text)
    return out


def _error_path(err: dict) -> list[str]:
    """Where an error is: its location, and below it the field a :class:`FieldError` names."""
    path = _field_path(err["loc"])
    cause = (err.get("ctx") or {}).get("error")
    return path + cause.param.split(".") if isinstance(cause, FieldError) else path


# Length limits, by pydantic error type: the bound, its context key, and what is counted
_LENGTH_LIMITS = {
    "too_long": ("takes at most", "max_length", "item"),
    "too_short": ("needs at least", "min_length", "item"),
    "string_too_long": ("takes at most", "max_length", "character"),
    "string_too_short": ("needs at least", "min_length", "character"),
}


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the offending field, its value and what is accepted (a length limit quotes the counts).

    Of several errors the deepest is reported: for a union (``str | list[Part]``) that is the member that got
    furthest, whose message is the useful one; members that failed at the same depth are joined with "or",
    type mismatches only when nothing more specific was said.
    """
    errors = exc.errors(include_url=False)
    depth = max(len(_error_path(e)) for e in errors)
    deepest = [e for e in errors if len(_error_path(e)) == depth]
    # a member whose type did not even match says less than one that got to check the value
    specific = [e for e in deepest if not e["type"].endswith("_type")]
    deepest = specific or deepest
    err = deepest[0]
    param = ".".join(_error_path(err)) or None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"{param}: unknown field", param=param, code="extra_forbidden")
    if err["type"] in _LENGTH_LIMITS:
        bound, key, noun = _LENGTH_LIMITS[err["type"]]
        limit = err["ctx"][key]
        message = f"{bound} {limit} {noun}{'' if limit == 1 else 's'}, got {len(err['input'])}"
        return APIError(400, f"{param}: {message}" if param else message, param=param, code=err["type"])
    reasons = " or ".join(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in deepest))
    message = f"{param}: {reasons}" if param else reasons
    if err["type"] != "missing" and not err["type"].startswith("value_error"):
        message += f" (got {json.dumps(err.get('input'), default=str)[:200]})"
    return APIError(400, message, param=param, code=err["type"])


# APIs with an error shape of their own (Anthropic's): path prefix -> the body of an error on that API, so that
# every error a client of it can meet (validation, auth, drain, routing) arrives in the shape its SDK reads.
_shapes: dict[str, Callable[[APIError], dict]] = {}


def use_shape(prefix: str, body: Callable[[APIError], dict]) -> None:
    _shapes[prefix] = body


def shaped_body(err: APIError) -> dict:
    path = request.path if has_request_context() else ""
    shape = next((body for prefix, body in _shapes.items() if path.startswith(prefix)), None)
    return shape(err) if shape is not None else err.body()


def json_error(err: APIError) -> Response:
    resp = Response(json.dumps(shaped_body(err)), status=err.status, mimetype="application/json")
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp


def init_app(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(err: APIError):
        return json_error(err)

    @app.errorhandler(ValidationError)
    def _validation(err: ValidationError):
        return json_error(from_validation_error(err))

    @app.errorhandler(HTTPException)
    def _http(err: HTTPException):
        status = err.code or 500
        if status == 413:
            return json_error(too_large())
        message = {
            404: "no such endpoint",
            405: "method not allowed for this endpoint",
        }.get(status, err.description or err.name)
        return json_error(APIError(status, message))

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        log.exception("unhandled error")
        return json_error(APIError(500, f"internal error ({type(err).__name__}); see the server log"))


def too_large() -> APIError:
    """The 413, after reading and dropping what is left of the body (see DISCARD_LIMIT)."""
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    length = request.content_length
    stream = request.environ.get("wsgi.input")
    if stream is not None and (length is None or length <= DISCARD_LIMIT):
        left = DISCARD_LIMIT
        while left > 0:
            chunk = stream.read(min(65536, left))
            if not chunk:
                break
            left -= len(chunk)
    got = f"{length} bytes" if length is not None else "a chunked body longer than that"
    return APIError(413, f"request body too large: at most {limit} bytes are accepted (GLM53_MAX_REQUEST_MB), got {got}", code="request_too_large")
