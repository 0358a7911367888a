"""``GET /openapi.json``: an OpenAPI 3.1 description of every endpoint, generated from the app itself.

Paths come from the app's URL map, request bodies from the pydantic wire types of ``server/protocol.py`` (the
same models that validate requests), so the description cannot drift from what the server accepts. Tools use
it to generate clients and to fuzz the server (``tests/server/test_fuzz.py``).
"""

from __future__ import annotations

import re

from flask import Blueprint, Flask, current_app
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .. import __version__
from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest, TokenizeRequest
from .responses_protocol import ResponsesRequest

bp = Blueprint("openapi", __name__)

# The body of every POST endpoint. Building the description fails for a POST route missing here, so a new
# endpoint cannot go undescribed.
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/responses": ResponsesRequest,
    "/generate": GenerateRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
STREAMING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/generate"})
TEXT_RESPONSES = frozenset({"/metrics"})

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}


@bp.get("/openapi.json")
def openapi():
    """This description."""
    doc = current_app.extensions.get("glm53.openapi")
    if doc is None:
        doc = current_app.extensions["glm53.openapi"] = describe(current_app)
    return doc


def describe(app: Flask) -> dict:
    """The OpenAPI document of ``app``. :raise KeyError: a POST route with no entry in REQUEST_BODIES."""
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_BODIES.values()], ref_template="#/components/schemas/{model}")
    paths: dict[str, dict] = {}
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        if rule.endpoint == "static" or rule.endpoint.startswith("web."):
            continue  # the built-in page is no API
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)  # flask <path:model_id> -> {model_id}
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            paths.setdefault(path, {})[method.lower()] = _operation(app, rule, method)
    return {
        "openapi": "3.1.0",
        "info": {"title": "glm53", "version": __version__,
                 "description": "GLM-5.3-Flash behind OpenAI-compatible APIs, Anthropic's Messages API and SGLang's /generate."},
        "paths": paths,
        "components": {
            "schemas": {**defs["$defs"], "Error": ERROR_SCHEMA},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _operation(app: Flask, rule, method: str) -> dict:
    doc = (app.view_functions[rule.endpoint].__doc__ or "").strip()
    if rule.rule in TEXT_RESPONSES:
        ok = {"text/plain": {"schema": {"type": "string"}}, "application/openmetrics-text": {"schema": {"type": "string"}}}
    else:
        ok = {"application/json": {"schema": {}}}
        if rule.rule in STREAMING:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict = {
        "operationId": rule.endpoint.replace(".", "_"),
        "summary": rule.endpoint.split(".")[-1].replace("_", " "),
        "responses": {
            "200": {"description": "success", "content": ok},
            "default": {"description": "an error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
        },
    }
    if doc:
        op["description"] = doc
    if rule.rule != "/health":
        op["security"] = [{}, {"bearer": []}]  # the key is required only when GLM53_API_KEY is set
    params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in sorted(rule.arguments)]
    if params:
        op["parameters"] = params
    if method == "POST":
        model = REQUEST_BODIES[rule.rule]
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return op
