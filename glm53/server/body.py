"""Reading a JSON request body into a validated wire type, with a clear 4xx for every way it can be wrong."""

from __future__ import annotations

import json

from flask import current_app, request
from pydantic import BaseModel, ValidationError

from .errors import APIError, from_validation_error, too_large


# Legitimate bodies nest a few levels, tool schemas a few tens; past this depth a body only exhausts the stack of
# code that walks it (templates, the output parser), which would turn bad input into a 500.
MAX_DEPTH = 128


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_body(model: type[BaseModel]):
    """:raise 400: invalid UTF-8 or JSON, not an object, or a field that fails validation.
    :raise 413: body over the configured limit (raised by werkzeug while reading)."""
    raw = request.get_data(cache=False)
    if request.content_length is None and len(raw) >= current_app.config["MAX_CONTENT_LENGTH"] and request.environ["wsgi.input"].read(1):
        raise too_large()  # werkzeug stops a chunked body at the limit without a word; a byte past it means too large
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_body") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", code="invalid_json") from None
    except ValueError as exc:  # NaN / Infinity literals
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_body")
    check_structure(data)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply", code="invalid_body") from None
    if body.model_extra:  # top-level bodies accept unknown fields (protocol.Lenient)
        current_app.extensions["glm53"].metrics.unknown_fields.note(request.url_rule.rule, body.model_extra)
    return body


def check_structure(data: object) -> None:
    """Refuse what valid JSON can hold but no handler can take: nesting past MAX_DEPTH, and text with an unpaired
    UTF-16 surrogate (a ``\\ud800`` escape decodes to a string that cannot be encoded, so it is not text).

    :raise 400: naming the field.
    """
    stack: list[tuple[object, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise APIError(400, f"the request body nests more than {MAX_DEPTH} levels deep (at {_dotted(path[:8])}...)", param=str(path[0]), code="invalid_body")
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path + (key,))
                stack.append((item, path + (key,)))
        elif isinstance(value, list):
            stack.extend((item, path + (i,)) for i, item in enumerate(value))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _dotted(path) or None
        raise APIError(400, f"{where or 'the request body'}: contains an unpaired UTF-16 surrogate "
                            f"(\\u{ord(text[exc.start]):04x} at character {exc.start}), which is not text", param=where, code="invalid_body") from None


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)
