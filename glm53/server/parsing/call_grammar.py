"""Grammars (llguidance's Lark dialect) for GLM tool calls that the output parser reads back as valid calls.

A call on the wire is ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`` (see
``output_parser.py``). A *typed* call holds its arguments to the tool's ``parameters`` schema, value by value,
the way ``arguments.py`` reads them back:

- a string-only parameter's value is raw text: a regex made from its ``enum``/``const``, ``pattern``,
  ``minLength`` and ``maxLength`` (``format`` is an annotation here, as JSON Schema 2020-12 has it);
- a parameter that is never a string takes JSON, llguidance's ``%json`` of its schema;
- a parameter that may be a string or something else takes either, its raw strings kept from reading like the
  JSON the parser would decode instead (``null`` for an ``Optional[str]``).

Keys are the declared properties, in declared order, each at most once, the required ones always; nothing else
is written, which every object schema accepts. A *loose* call names a declared function and leaves its pairs free.
No value or key may contain the text of the marker that would end it early (``</arg_value>``): the parser stops
at the first one, whether the model wrote the marker token or spelled it out.

One optional newline is allowed where the parser skips whitespace (after the name, around pairs), as GLM-4.5's
template writes them; the project's template writes none.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import llguidance

from glm53.engine.constraints import with_json_layout
from glm53.server.parsing.arguments import STRING_ONLY, json_type, value_types
from glm53.server.parsing.output_parser import (
    CALL_CLOSE,
    KEY_CLOSE,
    KEY_MARKERS,
    KEY_OPEN,
    VALUE_CLOSE,
    VALUE_OPEN,
)

NL = '"\\n"?'
ANY = "(?s:.*)"
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$id", "$schema", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions", "strict"})
# What a parameters object may say: no key but the declared ones is ever written, so additionalProperties
# (any value) is met, and only keywords that count or name keys would not be
PARAMETERS_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties"}) | ANNOTATIONS
STRING_KEYWORDS = frozenset({"pattern", "minLength", "maxLength", "format", "contentEncoding", "contentMediaType"})
# Keywords of the other types: they go to llguidance with the JSON part of a parameter that may be a string
OTHER_TYPE_KEYWORDS = frozenset({
    "items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "properties", "required",
    "additionalProperties", "patternProperties", "minProperties", "maxProperties", "propertyNames",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
MAYBE_STRING_KEYWORDS = frozenset({"type", "enum", "const", "anyOf", "oneOf"}) | STRING_KEYWORDS | OTHER_TYPE_KEYWORDS | ANNOTATIONS
NON_STRING_TYPES = ("null", "boolean", "integer", "number", "array", "object")
WS = r"[ \t\n\r]*"
# Raw text that json.loads reads as a value of each type (a superset for arrays and objects: any text that starts
# like one), which a raw string must not be where the parser would take the decoded value instead
JSON_LOOKS = {
    "null": "null",
    "boolean": "true|false",
    "integer": "-?(0|[1-9][0-9]*)",
    "number": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    "array": rf"\[{ANY}",
    "object": rf"\{{{ANY}",
}
MAX_REF_DEPTH = 32


class ToolSchemaError(ValueError):
    """A parameters schema that no grammar here can hold calls to; ``path`` is where in it (JSON-pointer-like)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"at {path}: {reason}" if path else reason)
        self.path = path


class CallGrammar:
    """The rules of one grammar under construction; each rule or terminal gets a fresh name.

    :param marker: how a grammar writes a control marker (``Vocabulary.marker``): the special token, or text.
    """

    def __init__(self, marker: Callable[[str], str]):
        self.marker = marker
        self._rules: list[str] = []

    def add(self, body: str, terminal: bool = False) -> str:
        """A new rule (or terminal, which llguidance lexes as one regex) with ``body``; returns its name."""
        name = f"{'T' if terminal else 'r'}{len(self._rules)}"
        self._rules.append(f"{name}: {body}")
        return name

    def text(self, start: str) -> str:
        """The grammar: ``start`` as its start rule, then every rule added."""
        return "\n".join([f"start: {start}", *self._rules])

    def free_text(self, *ends: str) -> str:
        """A terminal of any text without any of ``ends`` in it (possibly empty)."""
        banned = "|".join(_regex_literal(e) for e in ends)
        return self.add(f"/{ANY}/ & ~/{ANY}({banned}){ANY}/", terminal=True)

    # ----- calls

    def typed_call(self, name: str, parameters: Mapping[str, Any] | None) -> str:
        """A rule for ``NAME`` + arguments valid against ``parameters`` + ``</tool_call>`` (after ``<tool_call>``).

        :raise ToolSchemaError: a schema this cannot hold the arguments to.
        """
        return self.add(f"{json.dumps(name)} {self.typed_arguments(parameters)}")

    def typed_arguments(self, parameters: Mapping[str, Any] | None) -> str:
        """A rule for the argument pairs and ``</tool_call>``: what follows a call's name."""
        parameters = parameters or {}
        unknown = sorted(set(parameters) - PARAMETERS_KEYWORDS)
        if unknown:
            raise ToolSchemaError("", f"the keyword {unknown[0]!r} is not supported in the parameters of a call held to its schema")
        properties = parameters.get("properties") or {}
        if not isinstance(properties, Mapping):
            raise ToolSchemaError("/properties", "must be an object")
        required = parameters.get("required") or []
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise ToolSchemaError("/required", "must be a list of property names")
        extra = parameters.get("additionalProperties", True)
        root = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
        pairs = []
        for key in [*properties, *(k for k in dict.fromkeys(required) if k not in properties)]:
            path = f"/properties/{_pointer(key)}"
            if key not in properties and extra is False:
                raise ToolSchemaError("/required", f"{key!r} is required but not a property, and additionalProperties is false")
            schema = properties.get(key, extra if isinstance(extra, Mapping) else {})
            if schema is False:
                if key in required:
                    raise ToolSchemaError(path, "is required, and its schema (false) allows no value")
                continue
            if key.strip() != key or any(m in key for m in KEY_MARKERS):
                if key in required:
                    raise ToolSchemaError(path, "this name cannot be written as a GLM argument key (surrounding "
                                                "whitespace, or a call marker in it)")
                continue  # an optional property that cannot be written is left out
            pair = self.add(f"{NL} {self.marker(KEY_OPEN)} {json.dumps(key)} {self.marker(KEY_CLOSE)} {NL} "
                            f"{self.marker(VALUE_OPEN)} {self.value(schema, root, path)} {self.marker(VALUE_CLOSE)}")
            pairs.append(pair if key in required else pair + "?")
        return self.add(" ".join([*pairs, NL, self.marker(CALL_CLOSE)]))

    def loose_call(self, name: str) -> str:
        """A rule for ``NAME``, any argument pairs, ``</tool_call>``."""
        key = self.free_text(*KEY_MARKERS)
        value = self.free_text(VALUE_CLOSE)
        pair = self.add(f"{NL} {self.marker(KEY_OPEN)} {key} {self.marker(KEY_CLOSE)} {NL} {self.marker(VALUE_OPEN)} "
                        f"{value} {self.marker(VALUE_CLOSE)}")
        return self.add(f"{json.dumps(name)} {pair}* {NL} {self.marker(CALL_CLOSE)}")

    # ----- values

    def value(self, schema: Any, root: Mapping[str, Any], path: str) -> str:
        """A rule for one argument value valid against ``schema`` as the parser reads it.

        :param root: the parameters' ``$defs``/``definitions``, which references inside values point into.
        """
        if schema is True or schema == {}:
            schema = {}
        elif not isinstance(schema, Mapping):
            raise ToolSchemaError(path, "a property schema must be an object")
        types = value_types(schema)  # the parser's reading, of the schema as written
        strings, other = _split(schema, root, path)
        if types == STRING_ONLY:
            other = None  # the parser takes any text as the string, JSON-looking or not
        options = []
        if strings is not None:
            looks = [JSON_LOOKS[t] for t in (NON_STRING_TYPES if types is None else sorted(types - {"string"}))]
            banned = f" & ~/{WS}({'|'.join(looks)}){WS}/" if looks else ""
            options.append(self.add(f"({strings}) & ~/{ANY}{_regex_literal(VALUE_CLOSE)}{ANY}/{banned}", terminal=True))
        if other is not None:
            options.append(self.add("%json " + json.dumps(with_json_layout({**other, **root}))))
        if not options:
            raise ToolSchemaError(path, "no value satisfies this schema")
        return self.add(" | ".join(options))


def _split(schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> tuple[str | None, Mapping | None]:
    """(a terminal expression for the raw strings ``schema`` allows or None, a schema of its other values or None)."""
    types = value_types(schema)
    if types is not None and "string" not in types:
        return None, schema
    resolved = _resolve(schema, root, path)
    if resolved is not schema:
        types = value_types(resolved)
        if types is not None and "string" not in types:
            return None, schema  # llguidance follows the reference itself
    schema = resolved
    unknown = sorted(set(schema) - MAYBE_STRING_KEYWORDS)
    if unknown:
        raise ToolSchemaError(path, f"the keyword {unknown[0]!r} is not supported on a parameter that may be a string")
    for union in ("anyOf", "oneOf"):
        if union in schema:
            return _split_union(schema, union, root, path)
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise ToolSchemaError(f"{path}/enum", "must be a non-empty list")
        if "type" in schema:
            declared = _declared_types(schema["type"], path)
            values = [v for v in values if json_type(v) in declared or (json_type(v) == "integer" and "number" in declared)]
        strings = "|".join(json.dumps(v) for v in values if isinstance(v, str)) or None
        others = [v for v in values if not isinstance(v, str)]
        if strings is not None and set(schema) & STRING_KEYWORDS:
            strings = f"({strings}) & {_string_regex(schema, path)}"
        return strings, ({"enum": others} if others else None)
    declared = _declared_types(schema["type"], path) if "type" in schema else ("string", *NON_STRING_TYPES)
    strings = _string_regex(schema, path) if "string" in declared else None
    others = [t for t in declared if t != "string"]
    other = {**schema, "type": others[0] if len(others) == 1 else others} if others else None
    return strings, other


def _split_union(schema: Mapping[str, Any], union: str, root: Mapping[str, Any], path: str) -> tuple[str | None, Mapping | None]:
    members = schema[union]
    if not isinstance(members, list) or not members:
        raise ToolSchemaError(f"{path}/{union}", "must be a non-empty list of schemas")
    if set(schema) - ANNOTATIONS - {union}:
        raise ToolSchemaError(path, f"{union} with other keywords beside it is not supported on a parameter that may be a string")
    strings, others = [], []
    for i, member in enumerate(members):
        if not isinstance(member, Mapping):
            raise ToolSchemaError(f"{path}/{union}/{i}", "must be a schema object")
        raw, other = _split(member, root, f"{path}/{union}/{i}")
        strings += [raw] if raw is not None else []
        others += [other] if other is not None else []
    if union == "oneOf" and len(strings) > 1:
        # a string matching two members would break oneOf's "exactly one"
        raise ToolSchemaError(path, "oneOf with more than one member that may be a string is not supported")
    string_part = "|".join(f"({s})" for s in strings) or None
    other_part = (others[0] if len(others) == 1 else {union: others}) if others else None
    return string_part, other_part


def _declared_types(declared: Any, path: str) -> tuple[str, ...]:
    names = [declared] if isinstance(declared, str) else declared
    if not isinstance(names, list) or not names or not all(n in ("string", *NON_STRING_TYPES) for n in names):
        raise ToolSchemaError(f"{path}/type", f"must be a JSON type or a list of them, got {json.dumps(declared)[:80]}")
    return tuple(names)


def _string_regex(schema: Mapping[str, Any], path: str) -> str:
    """A terminal expression for the strings ``pattern``, ``minLength`` and ``maxLength`` allow."""
    parts = []
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ToolSchemaError(f"{path}/pattern", "must be a string")
        parts.append(_pattern_regex(pattern))
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    for name, bound in (("minLength", low), ("maxLength", high)):
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
            raise ToolSchemaError(f"{path}/{name}", "must be a non-negative integer")
    if low or high is not None:
        parts.append(f"/(?s:.){{{low},{'' if high is None else high}}}/")
    return " & ".join(parts) or f"/{ANY}/"


def _pattern_regex(pattern: str) -> str:
    """A JSON-Schema ``pattern`` (found anywhere in the string unless anchored) as a whole-string Lark regex.

    Only a leading ``^`` and a trailing ``$`` are taken as anchors; the regex is then the strings that contain a
    match there, which is what the pattern allows (or, with ``^``/``$`` inside alternatives, some of it).
    """
    start = pattern.startswith("^")
    end = pattern.endswith("$") and (len(pattern) - len(pattern[:-1].rstrip("\\")) - 1) % 2 == 0
    core = pattern[1 if start else 0:len(pattern) - 1 if end else len(pattern)]
    # JSON Schema's regexes are ECMA-262's: \d and \w are ASCII there
    core = llguidance.regex_to_lark(core, "dw")
    return f"/{'' if start else ANY}(?:{core}){'' if end else ANY}/"


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching itself, for inside ``/.../``."""
    return "".join(f"\\{c}" if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """``schema`` with a top-level local ``$ref`` (``#/$defs/X``, ``#/definitions/X``) followed; annotations
    beside it are dropped, anything else beside it is not supported here."""
    for _ in range(MAX_REF_DEPTH):
        ref = schema.get("$ref")
        if ref is None:
            return schema
        if set(schema) - ANNOTATIONS - {"$ref"}:
            raise ToolSchemaError(path, "$ref with other keywords beside it is not supported on a parameter that may be a string")
        parts = ref.split("/") if isinstance(ref, str) else []
        target = root.get(parts[1]) if len(parts) == 3 and parts[0] == "#" else None
        target = target.get(parts[2].replace("~1", "/").replace("~0", "~")) if isinstance(target, Mapping) else None
        if not isinstance(target, Mapping):
            raise ToolSchemaError(f"{path}/$ref", f"{json.dumps(ref)[:80]} does not name a schema under $defs or definitions")
        schema = target
    raise ToolSchemaError(f"{path}/$ref", f"references nest more than {MAX_REF_DEPTH} deep")


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
