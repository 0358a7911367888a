"""Hypothesis strategies for JSON values that follow, or nearly follow, a JSON Schema as pydantic writes it.

``valid`` covers the keywords of the server's OpenAPI description: ``$ref``, ``anyOf``/``oneOf``, ``const``,
``enum``, ``type`` (one or a list), ``properties``/``required``/``additionalProperties``, ``items`` with
``minItems``/``maxItems``, ``minLength``/``maxLength``/``pattern``, ``minimum``/``maximum`` and their exclusive
forms. Any other keyword that constrains values raises, so a new schema feature is noticed rather than fuzzed
wrongly. ``near_valid`` mixes valid instances with one mutation somewhere inside (a value replaced by any JSON,
a field dropped, an unknown field added), which reaches the validators' error paths as well as the handlers
behind them. Schema-valid bodies can still break cross-field rules the schema cannot express; the server must
answer those with a 4xx too.

``operation_cases`` turns one operation of this server's description into requests (target and body), for the
CPU fuzz (``test_fuzz.py``). The GPU machine has no hypothesis, so its fuzz (``tests/gpu/test_reliability_exl3.py``)
replays a fixed corpus drawn from the same strategies: ``python -m tests.server.schema_fuzz`` rewrites it (after
the API changes; ``test_fuzz.py`` checks that it still covers every operation).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

# ``discriminator`` only names the property whose ``const`` picks a ``oneOf`` member: the members constrain it
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "discriminator"})
KEYWORDS = frozenset({
    "$ref", "anyOf", "oneOf", "const", "enum", "type", "properties", "required", "additionalProperties", "items",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum",
}) | ANNOTATIONS

# Characters of every category, and lone surrogates on purpose: JSON carries them as \ud800 escapes, and the
# string they decode to cannot be encoded (hypothesis's own characters are whole code points).
SURROGATE_ONE_IN = 20  # strings; more often, and few bodies would get past the check that refuses them


def text(min_size: int = 0, max_size: int = 24):
    # st.text() drops surrogates from any alphabet, so those strings are joined from characters here
    clean = st.text(st.characters(), min_size=min_size, max_size=max_size)
    dirty = st.lists(st.characters() | st.characters(categories=["Cs"]), min_size=max(min_size, 1), max_size=max(max_size, 1)).map("".join)
    return st.integers(0, SURROGATE_ONE_IN - 1).flatmap(lambda i: dirty if i == 0 else clean)


TEXT = text()
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


class SchemaStrategies:
    """Strategies for the schemas of one OpenAPI document (``components`` resolves ``$ref``).

    ``hints`` are keywords laid over named component schemas: rules the validators enforce but the schema
    cannot say (a user message needs content), so that more generated bodies get past validation.
    """

    def __init__(self, components: dict[str, dict], max_items: int = 4, hints: dict[str, dict] | None = None):
        self.components = {name: {**schema, **(hints or {}).get(name, {})} for name, schema in components.items()}
        self.max_items = max_items

    def valid(self, schema: dict):
        unknown = set(schema) - KEYWORDS
        if unknown:
            raise ValueError(f"schema keyword(s) {sorted(unknown)} are not supported by this generator")
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[1]
            return st.deferred(lambda: self.valid(self.components[name]))
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return st.one_of([self.valid(member) for member in schema[key]])
        kind = schema.get("type")
        if kind is None:
            return ANY_JSON
        if isinstance(kind, list):
            return st.one_of([self.valid({**schema, "type": k}) for k in kind])
        return getattr(self, "_" + kind)(schema)

    def _null(self, schema):
        return st.none()

    def _boolean(self, schema):
        return st.booleans()

    def _integer(self, schema):
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -(2**70) - 1) + 1)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 2**70 + 1) - 1)
        # bounds and their neighbours are where range checks go wrong; the rest is spread over the range
        edges = st.sampled_from([v for v in (lo, lo + 1, hi - 1, hi, 0, 1) if lo <= v <= hi])
        return st.one_of(edges, st.integers(lo, hi))

    def _number(self, schema):
        return st.floats(
            min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
            max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
            allow_nan=False, allow_infinity=False,
        )

    def _string(self, schema):
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if "pattern" in schema:
            strategy = st.from_regex(schema["pattern"], fullmatch=True)
            return strategy.filter(lambda s: lo <= len(s) and (hi is None or len(s) <= hi))
        cap = lo + 24 if hi is None else min(hi, lo + 24)
        edges = [] if hi is None or hi > 4096 else [st.text(st.characters(codec="ascii"), min_size=hi, max_size=hi)]
        return st.one_of(text(lo, cap), *edges)

    def _array(self, schema):
        lo = schema.get("minItems", 0)
        hi = min(schema.get("maxItems", lo + self.max_items), lo + self.max_items)
        return st.lists(self.valid(schema.get("items", {})), min_size=lo, max_size=hi)

    def _object(self, schema):
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        extra = schema.get("additionalProperties", True)
        if not props:
            values = ANY_JSON if extra is True else self.valid(extra) if isinstance(extra, dict) else st.nothing()
            return st.dictionaries(TEXT, values, max_size=self.max_items)
        return st.fixed_dictionaries(
            {k: self.valid(v) for k, v in props.items() if k in required},
            optional={k: self.valid(v) for k, v in props.items() if k not in required},
        )


@st.composite
def near_valid(draw, strategies: SchemaStrategies, schema: dict):
    """A valid instance (a third of the time) or one with a single mutation at a random depth."""
    value = draw(strategies.valid(schema))
    if draw(st.integers(0, 2)) == 0:
        return value
    holder, key = _random_slot(draw, value)
    if holder is None:
        return draw(ANY_JSON)
    actions = ["add"] if key is None else ["replace", "drop", "add"] if isinstance(holder, dict) else ["replace", "drop"]
    action = draw(st.sampled_from(actions))
    if action == "replace":
        holder[key] = draw(ANY_JSON)
    elif action == "drop":
        del holder[key]
    else:
        holder[draw(TEXT.filter(lambda k: k not in holder))] = draw(ANY_JSON)
    return value


def _random_slot(draw, value, depth: int = 0):
    """A (container, key) inside ``value``, descending a random path; (None, None) for a scalar."""
    keys = list(value) if isinstance(value, dict) else list(range(len(value))) if isinstance(value, list) else []
    if not keys:
        return (value, None) if isinstance(value, dict) and depth == 0 else (None, None)
    key = draw(st.sampled_from(keys))
    child = value[key]
    if depth < 3 and isinstance(child, (dict, list)) and child and draw(st.booleans()):
        return _random_slot(draw, child, depth + 1)
    return value, key


# ----- this server's operations

ENDPOINTS = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"), ("POST", "/generate"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", "/v1/models/{model_id}"), ("GET", "/v1/models"), ("GET", "/health"),
    ("GET", "/stats"), ("GET", "/server_info"), ("GET", "/model_info"), ("GET", "/metrics"), ("GET", "/openapi.json"),
]
URL_TEXT = st.text(st.characters(codec="utf-8"), max_size=16)
# What the model validators of server/protocol.py require beyond the schema; half the bodies follow these.
HINTS = {
    "ChatMessage": {"required": ["role", "content"]},
    "ContentPart": {"properties": {"type": {"const": "text"}, "text": {"type": "string"}}, "required": ["type", "text"]},
    # a json_schema format needs its json_schema object; an empty schema accepts any JSON, so answers get made
    "ResponseFormat": {"required": ["type", "json_schema"]},
    "JsonSchemaFormat": {"properties": {"name": {"const": "answer"}, "schema": {"const": {}}}, "required": ["name", "schema"]},
    "TextFormat": {"properties": {"type": {"const": "text"}}},
    "HostedTool": {"properties": {"type": {"const": "web_search"}}},
}
GPU_CORPUS = Path(__file__).resolve().parents[1] / "gpu" / "fuzz_corpus.json"
GPU_CORPUS_CASES = {"POST": 24, "GET": 4, "GET /v1/models/{model_id}": 6}  # 150 in all
# The corpus takes every SPREAD-th case of a longer run: hypothesis builds many cases by varying the ones before,
# so consecutive cases are near copies
GPU_CORPUS_SPREAD = 8


# Most tokens a case of the GPU corpus may generate per choice when it is replayed (bounded): the GPU engine serves
# a long context, and an absent budget is the rest of it (the CPU fuzz covers uncapped budgets, on a short context)
FUZZ_BUDGET = 32


def bounded(path: str, body: str | None) -> bytes | None:
    """A corpus body with its token budget capped at FUZZ_BUDGET, and set where an absent one means the rest of the
    context; anything that is not a JSON object is sent as it is. ``/v1/messages`` needs its budget: left out, the
    answer is a 400, so it stays out."""
    if body is None:
        return None
    value = json.loads(body)
    if isinstance(value, dict):
        if path in ("/v1/chat/completions", "/v1/completions"):
            for key in [k for k in ("max_tokens", "max_completion_tokens") if k in value] or ["max_tokens"]:
                value[key] = _cap(value.get(key))
        elif path == "/v1/responses":
            value["max_output_tokens"] = _cap(value.get("max_output_tokens"))
        elif path == "/v1/messages" and "max_tokens" in value:
            value["max_tokens"] = _cap(value["max_tokens"])
        elif path == "/generate":
            params = value.setdefault("sampling_params", {})
            if isinstance(params, dict):
                params["max_new_tokens"] = _cap(params.get("max_new_tokens"))
    return json.dumps(value).encode()


def _cap(budget):
    if budget is None:
        return FUZZ_BUDGET
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return min(budget, FUZZ_BUDGET)  # a float like 1e20 would pass as an integer
    return budget  # not a number: the server refuses it


def operation_cases(doc: dict, method: str, path: str):
    """A strategy of (request target, body) for one operation of the OpenAPI document ``doc``."""
    op = doc["paths"][path][method.lower()]
    plain, hinted = (SchemaStrategies(doc["components"]["schemas"], hints=h) for h in (None, HINTS))
    if method == "POST":
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        body = st.one_of(near_valid(plain, schema), near_valid(hinted, schema)).map(lambda v: json.dumps(v).encode())
        return st.tuples(st.just(path), body)
    if op.get("parameters"):
        # arbitrary bytes, percent-encoded: invalid UTF-8 in the path is part of the fuzz
        segment = st.binary(max_size=24).map(lambda b: urllib.parse.quote_from_bytes(b, safe=""))
        return st.tuples(segment.map(lambda seg: path.replace("{model_id}", seg)), st.none())
    query = st.dictionaries(URL_TEXT, URL_TEXT, max_size=3).map(urllib.parse.urlencode)
    return st.tuples(query.map(lambda q: f"{path}?{q}" if q else path), st.none())


def send(port: int, method: str, target: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
    """(status, body) of one request on a fresh connection. :raise AssertionError: no answer within ``timeout``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, target, body=body, headers={"Content-Type": "application/json"} if body is not None else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except TimeoutError:
        raise AssertionError(f"{method} {target} hung for over {timeout} s; body {body[:300] if body else None!r}") from None
    finally:
        conn.close()


def draw(doc: dict, method: str, path: str, count: int) -> list[tuple[str, bytes | None]]:
    """``count`` cases of one operation (fewer if hypothesis runs out of distinct ones), the same every run."""
    drawn: list[tuple[str, bytes | None]] = []

    @settings(max_examples=count, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(operation_cases(doc, method, path))
    def collect(case):
        drawn.append(case)

    collect()
    return drawn


def gpu_corpus(doc: dict) -> dict:
    """The GPU fuzz's cases: GPU_CORPUS_CASES per operation, bodies as JSON text."""
    cases = []
    for method, path in ENDPOINTS:
        count = GPU_CORPUS_CASES.get(f"{method} {path}", GPU_CORPUS_CASES[method])
        for target, body in draw(doc, method, path, count * GPU_CORPUS_SPREAD)[::GPU_CORPUS_SPREAD]:
            cases.append({"operation": f"{method} {path}", "target": target, "body": None if body is None else body.decode()})
    return {"written_by": "python -m tests.server.schema_fuzz", "cases": cases}


def main() -> None:
    """Rewrite GPU_CORPUS from the OpenAPI description of a scripted server built in this process."""
    from glm53 import config
    from glm53.server import create_app
    from tests.fakes import ScriptedBackend

    app = create_app(config.load([], {}), backend_factory=ScriptedBackend)
    doc = app.test_client().get("/openapi.json").get_json()
    corpus = gpu_corpus(doc)
    GPU_CORPUS.write_text(json.dumps(corpus, indent=1) + "\n")
    print(f"wrote {len(corpus['cases'])} cases to {GPU_CORPUS}")


if __name__ == "__main__":
    main()
