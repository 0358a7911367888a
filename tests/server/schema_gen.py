"""Hypothesis strategies for the JSON schemas that structured answers and tool parameters are held to.

They draw from the features clients use: nested objects with required and optional properties (with and without
``additionalProperties: false``), arrays with item bounds, enums and consts of mixed types, ``anyOf``, integers and
numbers with (exclusive) bounds, strings with lengths and patterns (anchored and not; fixed patterns, so that
Python's ``re``, which ``jsonschema`` uses, and llguidance's Rust regexes read them alike), and ``null``.
"""

from __future__ import annotations

from hypothesis import strategies as st

NAMES = ["id", "name", "count", "ok", "items", "when", "x", "y", "label", "kind"]
PATTERNS = ["^[a-z]{1,6}$", "^[A-Z][a-z]{0,5}$", "^[0-9]{3}-[0-9]{2}$", "ab", "^x", "[0-9]$"]
SCALARS = st.none() | st.booleans() | st.integers(-50, 50) | st.sampled_from(["a", "b c", "null", "12", ""])


@st.composite
def integer_schema(draw):
    schema = {"type": "integer"}
    low = draw(st.none() | st.integers(-100, 100))
    if low is not None:
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    if draw(st.booleans()):
        schema["maximum"] = (low if low is not None else 0) + draw(st.integers(2, 1000))
    return schema


@st.composite
def number_schema(draw):
    low = draw(st.integers(-10, 10))
    return {"type": "number", "minimum": low, "maximum": low + draw(st.integers(1, 100))}


@st.composite
def string_schema(draw):
    schema = {"type": "string"}
    if draw(st.booleans()):
        schema["pattern"] = draw(st.sampled_from(PATTERNS))
    low = draw(st.integers(0, 3))
    if low:
        schema["minLength"] = low
    schema["maxLength"] = low + draw(st.integers(0, 12))
    return schema


LEAVES = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}), integer_schema(), number_schema(), string_schema(),
    st.lists(SCALARS, min_size=1, max_size=4, unique_by=repr).map(lambda values: {"enum": values}),
    SCALARS.map(lambda value: {"const": value}),
)


def schemas(max_leaves: int = 6):
    """Any value schema: leaves, objects, arrays, anyOf of them."""
    return st.recursive(LEAVES, lambda inner: st.one_of(
        objects(inner),
        st.builds(lambda items, low, extra: {"type": "array", "items": items, "minItems": low, "maxItems": low + extra},
                  inner, st.integers(0, 2), st.integers(0, 3)),
        st.lists(inner, min_size=2, max_size=3).map(lambda members: {"anyOf": members}),
    ), max_leaves=max_leaves)


@st.composite
def objects(draw, values):
    """An object schema: some of NAMES as properties, some required, maybe closed to others."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=0, max_size=4, unique=True))
    schema = {"type": "object", "properties": {n: draw(values) for n in names}}
    required = [n for n in names if draw(st.booleans())]
    if required:
        schema["required"] = required
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


def parameters():
    """A tool's parameters: an object schema over any values."""
    return objects(schemas(max_leaves=4))
