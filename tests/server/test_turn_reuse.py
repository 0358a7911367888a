"""Does the GLM-5 chat template render an earlier assistant turn back exactly as it was generated?

That decides how much of an agent's next request the prefix cache can serve: up to the end of the previous
answer when it does, else only up to the end of the previous prompt (where a checkpoint sits). The generated
text is the prompt (ending ``<|assistant|><think>``) plus the model's output; the next request renders the same
messages plus the answer (as the APIs hand it back: reasoning, content, tool calls) and what followed.

Findings (built-in template, which follows the GLM-5 one): a turn is rendered back byte for byte when its
reasoning and content carry no leading or trailing whitespace (the template strips both) and its tool calls are
in the tag format with string values raw (non-strings as ``json.dumps`` writes them), as GLM generates them;
- inside a tool loop (no user message after the turn) reasoning is kept, so the whole answer is reused;
- after a new user message the template clears earlier turns' reasoning (``<think></think>``), so reuse ends at
  the previous prompt's end, unless ``clear_thinking`` is false (GLM's preserved thinking; ``/v1/messages``
  sets it when the client asks to keep all thinking, as Claude Code does);
- with thinking off the answer is reused in every case.
"""

from __future__ import annotations

import pytest

from glm53.models.chat_template import ChatTemplate

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}}
GENERATED_CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"


@pytest.fixture(scope="module")
def template():
    return ChatTemplate.builtin()


def reused(template, first: list[dict], output: str, answer: dict, after: list[dict], **kwargs) -> int:
    """Characters of the first request plus its output that the next request starts with."""
    generated = template.render(first, TOOLS, **kwargs).text + output
    following = template.render([*first, answer, *after], TOOLS, **kwargs).text
    n = 0
    while n < min(len(generated), len(following)) and generated[n] == following[n]:
        n += 1
    return n if n < len(generated) else len(generated)


def test_inside_a_tool_loop_the_whole_answer_is_reused(template):
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "weather?"}]
    answer = {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [CALL]}
    generated = template.render(first, TOOLS).text + "Look it up.</think>" + GENERATED_CALL
    n = reused(template, first, "Look it up.</think>" + GENERATED_CALL, answer, [{"role": "tool", "tool_call_id": "call_1", "content": "sun"}])
    assert n == len(generated)


def test_after_a_new_user_message_reasoning_is_cleared_unless_clear_thinking_is_false(template):
    first = [{"role": "user", "content": "hi"}]
    answer = {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."}
    prompt = template.render(first, TOOLS).text
    after = [{"role": "user", "content": "and now?"}]
    assert reused(template, first, "Greet back.</think>Hello.", answer, after) == len(prompt)  # ends at `<think>`
    kept = reused(template, first, "Greet back.</think>Hello.", answer, after, clear_thinking=False)
    assert kept == len(prompt + "Greet back.</think>Hello.")


def test_with_thinking_off_the_answer_is_reused(template):
    first = [{"role": "user", "content": "hi"}]
    answer = {"role": "assistant", "content": "Hello."}
    n = reused(template, first, "Hello.", answer, [{"role": "user", "content": "more"}], enable_thinking=False)
    assert n == len(template.render(first, TOOLS, enable_thinking=False).text + "Hello.")


def test_whitespace_around_the_reasoning_is_not_rendered_back(template):
    first = [{"role": "user", "content": "weather?"}]
    answer = {"role": "assistant", "content": "", "reasoning_content": "\nLook it up.\n", "tool_calls": [CALL]}
    prompt = template.render(first, TOOLS).text
    n = reused(template, first, "\nLook it up.\n</think>" + GENERATED_CALL, answer, [{"role": "tool", "tool_call_id": "call_1", "content": "x"}])
    assert n == len(prompt)  # the strip diverges at the reasoning's first character
