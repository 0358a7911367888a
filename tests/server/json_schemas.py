"""Hand-written JSON schemas and tools for the constrained-decoding tests, CPU and GPU (which has no hypothesis).

Each covers a feature a structured answer or a tool call must get right: nested objects, arrays with bounds,
enums, anyOf, numbers with bounds, strings with patterns and lengths, required and optional properties,
references, and the parameters whose values GLM writes raw (strings) or as JSON (everything else) or either.

SCHEMAS and E2E_TOOLS bound every string, array and object (maxLength, maxItems, additionalProperties false), as
OpenAI's strict mode asks: a random-weight model (the GPU tests' synthetic checkpoint) draws from 155k tokens,
and would almost never pick the one that closes an unbounded string. TOOLS adds a tool with an untyped
parameter, for the CPU tests, whose demo model closes what it opens.
"""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

SCHEMAS = {
    "person": PERSON,
    "nested": {
        "type": "object",
        "properties": {
            "owner": PERSON,
            "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30},
                                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["zip"], "additionalProperties": False},
            "score": {"type": "number", "exclusiveMinimum": -1, "maximum": 1},
        },
        "required": ["owner", "score"],
        "additionalProperties": False,
    },
    "union": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 20}, {"type": "string", "maxLength": 5},
                                {"type": "null"}]},
            "kind": {"const": "measurement"},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
        },
        "required": ["value", "kind"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3}},
        "required": ["path"],
        "additionalProperties": False,
    },
    "array_root": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    "unanchored_pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "ab", "maxLength": 10}},
                           "required": ["code"], "additionalProperties": False},
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    }, "required": ["city", "days"]},
}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NOTE = {"type": "function", "function": {
    "name": "save_note",
    "parameters": {
        "$defs": {"level": {"enum": ["low", "high"]},
                  "size": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 99}},
                           "required": ["w"], "additionalProperties": False}},
        "type": "object",
        "properties": {
            "text": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]},
            "count": {"type": ["integer", "string"], "maxLength": 4, "minimum": 0, "maximum": 999},
            "level": {"$ref": "#/$defs/level"},
            "size": {"$ref": "#/$defs/size"},
            "labels": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        },
        "required": ["text", "level"],
        "additionalProperties": False,
    },
}}
E2E_TOOLS = [WEATHER, TIME, NOTE]
# Values of every shape the parser types differently: raw strings, JSON, either, untyped, references
MIXED = {"type": "function", "function": {
    "name": "record",
    "parameters": {
        "$defs": {"color": {"enum": ["red", "green"]}, "box": {"type": "object", "properties": {"w": {"type": "integer"}},
                                                                "required": ["w"]}},
        "type": "object",
        "properties": {
            "note": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
            "count": {"type": ["integer", "string"], "maxLength": 6},
            "anything": {},
            "color": {"$ref": "#/$defs/color"},
            "box": {"$ref": "#/$defs/box"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "items": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        },
        "required": ["note", "count", "color", "code"],
    },
}}
TOOLS = [WEATHER, TIME, NOTE, MIXED]


def parameters(tools: list[dict], name: str) -> dict:
    return next(t["function"].get("parameters") or {} for t in tools if t["function"]["name"] == name)
