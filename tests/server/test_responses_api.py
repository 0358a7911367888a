"""``/v1/responses`` end to end over real gunicorn + gevent with a scripted model, the official ``openai`` SDK as the
arbiter of the wire format (its stream state checks event order and item identities). Its refusals run
in-process: ``test_scripted_app.py``."""

from __future__ import annotations

import openai
import pytest

from .scripted_server import AGENT_ANSWER
from .servers import Server, openai_client

MODEL = "glm-5.3-flash"
WEATHER = {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    s = Server(["--max-batch-size", "4", "-cs", "4096", "--responses-store", "2"], module="tests.server.scripted_server").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def test_plain_answer_with_reasoning_off(client):
    r = client.responses.create(model=MODEL, input="hi [[script:plain]]", reasoning={"effort": "none"})
    assert (r.status, r.output_text, [i.type for i in r.output]) == ("completed", "Hello there, friend.", ["message"])
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens == len("Hello there, friend.") + 1 and r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_reasoning_item_then_message(client):
    r = client.responses.create(model=MODEL, input="[[script:think]]", include=["reasoning.encrypted_content"])
    reasoning, message = r.output
    assert (reasoning.type, reasoning.content[0].text, r.output_text) == ("reasoning", "Let me think about it.", "The answer is 4.")
    assert reasoning.encrypted_content and r.usage.output_tokens_details.reasoning_tokens == len("Let me think about it.")


def test_stream_helper_gives_the_plain_calls_output(client):
    kwargs = {"model": MODEL, "input": "[[script:weather]]", "tools": [WEATHER]}
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.reasoning_text.delta" in kinds
    assert [i.type for i in final.output] == [i.type for i in plain.output] == ["reasoning", "function_call"]
    call = final.output[1]
    assert (call.name, call.arguments) == ("get_weather", '{"city": " New York\\n", "days": 3}')
    assert call.call_id.startswith("call_") and final.usage.output_tokens == plain.usage.output_tokens


def test_streamed_text_events_in_order(client):
    events = list(client.responses.create(model=MODEL, input="[[script:think]]", stream=True))
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    text_item = [e.type for e in events if getattr(e, "output_index", None) == 1]
    assert text_item[:2] == ["response.output_item.added", "response.content_part.added"]
    assert text_item[-3:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "The answer is 4."


def test_function_call_loop_with_the_output_sent_back(client):
    first = client.responses.create(model=MODEL, input="Weather? [[script:agent_weather]]", tools=[WEATHER], store=False)
    call = next(i for i in first.output if i.type == "function_call")
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
    history = [{"role": "user", "content": "Weather? [[script:agent_weather]]"}, *[i.model_dump(exclude_none=True) for i in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(model=MODEL, input=history, tools=[WEATHER], store=False)
    assert second.output_text == AGENT_ANSWER + "sunny, 21 C"


def test_previous_response_id_continues_a_stored_conversation(client):
    first = client.responses.create(model=MODEL, input="Weather? [[script:agent_weather]]", tools=[WEATHER])
    call = next(i for i in first.output if i.type == "function_call")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}])
    assert second.output_text == AGENT_ANSWER + "rain" and second.previous_response_id == first.id
    for _ in range(2):  # the store keeps two: the first is dropped
        client.responses.create(model=MODEL, input="[[script:plain]]")
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="again")
    assert (gone.value.body["param"], gone.value.body["code"]) == ("previous_response_id", "previous_response_not_found")


def test_max_output_tokens_gives_an_incomplete_response(client):
    r = client.responses.create(model=MODEL, input="[[script:plain]]", max_output_tokens=5, reasoning={"effort": "none"})
    assert (r.status, r.incomplete_details.reason, r.output_text) == ("incomplete", "max_output_tokens", "Hello")


def test_hosted_tools_are_left_out_and_forced_calls_work(client):
    r = client.responses.create(model=MODEL, input="[[script:forced]]", tools=[WEATHER, {"type": "web_search"}],
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", '{"city": "Oslo"}')
    assert [t.type for t in r.tools] == ["function"]


def test_text_format_json_schema_is_held_to_its_schema(client):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="[[script:plain]]", max_output_tokens=64, reasoning={"effort": "none"},
                                text={"format": {"type": "json_schema", "name": "digit", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
