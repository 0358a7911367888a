"""Typing GLM tool-call argument values by the request's tool schemas.

The GLM chat template writes a string argument raw and any other value as JSON
(``value if value is string else value | tojson``). Reading a value back inverts that:

- a parameter whose schema allows only ``string``: the raw text is the string, whitespace kept exactly
  (these are the only values streamed piece by piece);
- otherwise the text is decoded as JSON. A decoded number, boolean, null, array or object is the value,
  except that when the schema also allows ``string`` the decoded type must be one the schema allows
  (``Optional[str]`` reads ``null`` as null but ``123`` as "123"). Text that does not decode, or decodes
  to a JSON string (the template never quotes strings, so the quotes were the model's), stays the raw
  string. Parameters without a schema type are decoded the same way, so ``5``, ``true``, ``[1,2]`` are
  values, not strings.

Allowed types come from ``type`` (a name or a list), ``anyOf``/``oneOf`` members, ``enum`` and ``const``;
a member without any of these (a ``$ref``, ``{}``) allows anything, which makes the parameter untyped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

STRING_ONLY = frozenset({"string"})
NOT_JSON = object()  # decode_json's answer for text that is not JSON (None is the JSON null)


def tool_properties(tools: list[dict] | None) -> dict[str, Mapping[str, Any]]:
    """Each declared function's name mapped to its ``parameters.properties`` (empty when absent)."""
    table: dict[str, Mapping[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        table[function["name"]] = properties if isinstance(properties, Mapping) else {}
    return table


def value_types(schema: Any) -> frozenset[str] | None:
    """The JSON types a parameter schema allows; None when it does not say (untyped)."""
    if not isinstance(schema, Mapping):
        return None
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(name for name in declared if isinstance(name, str))
    for union in ("anyOf", "oneOf"):
        members = schema.get(union)
        for member in members if isinstance(members, list) else []:
            member_types = value_types(member)
            if member_types is None:
                return None
            types |= member_types
    if isinstance(schema.get("enum"), list):
        types.update(json_type(value) for value in schema["enum"])
    if "const" in schema:
        types.add(json_type(schema["const"]))
    return frozenset(types) or None


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def encode_value(text: str, types: frozenset[str] | None) -> str:
    """The JSON text of one argument value given as raw text (rules in the module docstring)."""
    value = NOT_JSON if types == STRING_ONLY else decode_json(text)
    if value is NOT_JSON or isinstance(value, str):
        return json.dumps(text, ensure_ascii=False)
    if types is not None and "string" in types and not _allowed(value, types):
        return json.dumps(text, ensure_ascii=False)
    return dump_json(value)


def _allowed(value: Any, types: frozenset[str]) -> bool:
    kind = json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def decode_json(text: str) -> Any:
    """``json.loads`` that refuses NaN and infinities (``NaN``, ``1e999``): ``json.dumps`` would write them
    back as invalid JSON. ``NOT_JSON`` when the text is not JSON."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return NOT_JSON


def dump_json(value: Any) -> str:
    """JSON text of a decoded value, UTF-8 encodable."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate from a "\ud800" escape cannot be written raw; keep it escaped.
        text = json.dumps(value)
    return text


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} overflows a float")
    return value
