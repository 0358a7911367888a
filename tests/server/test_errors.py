"""Validation errors become 400s that name the field in ``param`` (unit level: the request models and the
mapping in ``server/errors.py``; the e2e suites check the same over HTTP)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from glm53.server.body import check_structure
from glm53.server.errors import APIError, from_validation_error
from glm53.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, TokenizeRequest

USER = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def refusal(model, body: dict):
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    return from_validation_error(exc.value)


@pytest.mark.parametrize("model,body,param,message", [
    (ChatCompletionRequest, {"messages": USER, "tool_choice": "required"}, "tool_choice",
     "tool_choice: 'required' and a named function need 'tools'"),
    (ChatCompletionRequest, {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "tool_choice: names 'g', which is not in 'tools'"),
    (ChatCompletionRequest, {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options: only allowed when stream is true"),
    (ChatCompletionRequest, {"messages": USER, "chat_template_kwargs": {"enable_thinking": "no"}},
     "chat_template_kwargs.enable_thinking", "chat_template_kwargs.enable_thinking: must be true or false"),
    (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages.0.content", "messages.0.content: a user message needs 'content'"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages.0.tool_calls", "messages.0.tool_calls: only assistant messages carry 'tool_calls'"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0.type",
     "messages.0.content.0.type: content parts of type 'image_url' are not supported; only 'text' is"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text",
     "messages.0.content.0.text: a 'text' content part needs a 'text' string"),
    (CompletionRequest, {"prompt": "x", "suffix": "y"}, "suffix", "suffix: fill-in-the-middle is not supported"),
    (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of", "best_of: values other than 1 are not supported; use n"),
    (CompletionRequest, {"prompt": "x", "stream_options": {}}, "stream_options", "stream_options: only allowed when stream is true"),
    (GenerateRequest, {}, "text", "text: give exactly one of 'text' and 'input_ids'"),
    (TokenizeRequest, {"text": "a", "prompt": "b"}, "text", "text: give exactly one of 'text' and 'prompt'"),
])
def test_a_broken_cross_field_rule_names_its_field(model, body, param, message):
    err = refusal(model, body)
    assert (err.status, err.param, err.message) == (400, param, message)


@pytest.mark.parametrize("body,param,message", [
    ({"messages": USER, "stop": ["s"] * 5000}, "stop", "stop: takes at most 64 items, got 5000"),
    ({"messages": USER, "stop": ["s" * 5000]}, "stop.0", "stop.0: takes at most 1024 characters, got 5000"),
    ({"messages": USER, "stop": "s" * 2000}, "stop", "stop: takes at most 1024 characters, got 2000"),
    ({"messages": []}, "messages", "messages: needs at least 1 item, got 0"),
])
def test_length_limits_quote_the_counts_not_the_value(body, param, message):
    err = refusal(ChatCompletionRequest, body)
    assert (err.param, err.message) == (param, message)


def test_a_body_nested_too_deeply_names_the_top_level_field_it_is_under():
    deep: object = 1
    for _ in range(200):
        deep = {"a": deep}
    with pytest.raises(APIError) as exc:
        check_structure({"model": "m", "chat_template_kwargs": deep})
    assert exc.value.param == "chat_template_kwargs" and "nests more than 128 levels deep" in exc.value.message
