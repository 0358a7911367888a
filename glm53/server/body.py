"""Reading a JSON request body into a validated wire type, with a clear 4xx for every way it can be wrong."""

from __future__ import annotations

import json

from flask import request
from pydantic import BaseModel, ValidationError

from .errors import APIError, from_validation_error


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_body(model: type[BaseModel]):
    """:raise 400: invalid UTF-8 or JSON, not an object, or a field that fails validation.
    :raise 413: body over the configured limit (raised by werkzeug while reading)."""
    raw = request.get_data(cache=False)
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
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply", code="invalid_body") from None
