import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm53.models.chat_template import ChatTemplate
from glm53.server.parsing import (
    ContentText,
    OutputParser,
    ParsedOutput,
    ParsedToolCall,
    ReasoningText,
    ToolCallArguments,
    ToolCallBegin,
    ToolCallEnd,
    collect,
    new_call_id,
    parse_output,
)


def tool(name, properties=None):
    function = {"name": name}
    if properties is not None:
        function["parameters"] = {"type": "object", "properties": properties}
    return {"type": "function", "function": function}


TOOLS = [
    tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}),
    tool("get_time"),
    tool("run", {
        "cmd": {"type": "string"},
        "timeout": {"type": "number"},
        "verbose": {"type": "boolean"},
        "env": {"type": "object"},
        "args": {"type": "array", "items": {"type": "string"}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "mode": {"enum": ["fast", "slow"]},
        "ref": {"$ref": "#/defs/x"},
        "anything": {},
    }),
]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(text, tools=TOOLS, reasoning_open=False):
    return parse_output(text, tools, reasoning_open, id_factory=ids())


def stream(chunks, tools=TOOLS, reasoning_open=False):
    parser = OutputParser(tools, reasoning_open, id_factory=ids())
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    return events + parser.finish()


def calls(*pairs):
    return [ParsedToolCall(id=f"call_{i}", name=name, arguments=arguments) for i, (name, arguments) in enumerate(pairs)]


def test_default_ids_are_call_and_24_hex():
    call_id = parse_output("<tool_call>get_time</tool_call>", TOOLS, False).tool_calls[0].id
    assert call_id.startswith("call_") and len(call_id) == 29
    assert int(call_id[5:], 16) >= 0
    assert new_call_id() != new_call_id()


@pytest.mark.parametrize(("text", "reasoning_open", "expected"), [
    ("Just an answer.", False, ParsedOutput(None, "Just an answer.", [])),
    ("thinking hard", True, ParsedOutput("thinking hard", None, [])),
    ("thoughts</think>answer", True, ParsedOutput("thoughts", "answer", [])),
    ("  \n<think>thoughts</think>\nanswer", False, ParsedOutput("thoughts", "\nanswer", [])),
    ("<think>cut off", False, ParsedOutput("cut off", None, [])),
    ("<think></think>   ", False, ParsedOutput(None, None, [])),
    ("answer <think>not reasoning</think>", False, ParsedOutput(None, "answer <think>not reasoning</think>", [])),
    ("a < b and c<d, x </thin y", False, ParsedOutput(None, "a < b and c<d, x </thin y", [])),
    ("x</think>", False, ParsedOutput(None, "x</think>", [])),
])
def test_reasoning_and_content(text, reasoning_open, expected):
    assert parse(text, reasoning_open=reasoning_open) == expected
    assert parse(text, tools=None, reasoning_open=reasoning_open) == expected


def test_zero_argument_call():
    assert parse("<tool_call>get_time</tool_call>") == ParsedOutput(None, None, calls(("get_time", "{}")))
    assert parse("<tool_call> get_time \n</tool_call>") == ParsedOutput(None, None, calls(("get_time", "{}")))


def test_several_arguments_and_several_calls():
    text = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key><arg_value>3</arg_value>\n</tool_call>\n"
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>")
    assert parse(text) == ParsedOutput(None, "Let me check.\n\n", calls(
        ("get_weather", '{"city": "Paris", "days": 3}'), ("get_weather", '{"city": "Rome"}')))


@pytest.mark.parametrize(("key", "raw", "expected"), [
    ("cmd", "  ls -la \n", "  ls -la \n"),
    ("cmd", '"quoted"', '"quoted"'),
    ("cmd", "42", "42"),
    ("cmd", 'a\\b "c"\n\ttab é 😀 \u2028', 'a\\b "c"\n\ttab é 😀 \u2028'),
    ("cmd", "<b>bold</b> <arg_key>", "<b>bold</b> <arg_key>"),
    ("timeout", " 2.5 ", 2.5),
    ("timeout", "soon", "soon"),
    ("timeout", "NaN", "NaN"),
    ("timeout", "1e999", "1e999"),
    ("args", '["\\ud800", "é"]', ["\ud800", "é"]),
    ("verbose", "true", True),
    ("env", '{"A": "1", "B": [1, 2]}', {"A": "1", "B": [1, 2]}),
    ("args", '["-l", "a b"]', ["-l", "a b"]),
    ("args", "[1, 2", "[1, 2"),
    ("note", "null", None),
    ("note", "123", "123"),
    ("note", "hello", "hello"),
    ("mode", "fast", "fast"),
    ("ref", "7", 7),
    ("anything", "[1,2]", [1, 2]),
    ("anything", '"x"', '"x"'),
    ("undeclared", "5", 5),
    ("undeclared", "true", True),
    ("undeclared", "null", None),
    ("undeclared", "free text", "free text"),
])
def test_values_typed_by_schema(key, raw, expected):
    text = f"<tool_call>run<arg_key>{key}</arg_key><arg_value>{raw}</arg_value></tool_call>"
    result = parse(text)
    assert result.content is None
    assert json.loads(result.tool_calls[0].arguments) == {key: expected}
    assert result.tool_calls[0].arguments.encode("utf-8")


def test_string_value_streams_piece_by_piece():
    events = stream(["<tool_call>run<arg_key>cmd</arg_key><arg_value>ec", 'ho "hi', '"\n</arg_val', "ue></tool_call>"])
    assert events == [
        ToolCallBegin(0, "call_0", "run"),
        ToolCallArguments(0, "{"),
        ToolCallArguments(0, '"cmd": "'),
        ToolCallArguments(0, "ec"),
        ToolCallArguments(0, 'ho \\"hi'),
        ToolCallArguments(0, '\\"\\n'),
        ToolCallArguments(0, '"'),
        ToolCallArguments(0, "}"),
        ToolCallEnd(0),
    ]


def test_name_is_complete_before_begin():
    # A streamed name must never be cut (run_in_terminal -> run_in).
    tools = [tool("run_in"), tool("run_in_terminal")]
    parser = OutputParser(tools, False, id_factory=ids())
    assert parser.feed("<tool_call>run_in") == []
    assert parser.feed("_terminal") == []
    assert parser.feed("</tool_call>") == [ToolCallBegin(0, "call_0", "run_in_terminal"), ToolCallArguments(0, "{"),
                                           ToolCallArguments(0, "}"), ToolCallEnd(0)]


def test_json_variant():
    assert parse('<tool_call>get_weather\n{"city": "Paris", "days": 2}</tool_call>') == ParsedOutput(
        None, None, calls(("get_weather", '{"city": "Paris", "days": 2}')))
    assert parse('<tool_call>get_weather>{"city": "Oslo"}</tool_call>').tool_calls == calls(
        ("get_weather", '{"city": "Oslo"}'))


def test_json_variant_that_is_not_an_object():
    assert parse("<tool_call>get_weather{city: Paris}</tool_call>after") == ParsedOutput(
        None, "{city: Paris}</tool_call>after", calls(("get_weather", "{}")))


def test_call_inside_reasoning():
    text = "I need the time.<tool_call>get_time</tool_call>Then answer.</think>It is noon."
    assert parse(text, reasoning_open=True) == ParsedOutput(
        "I need the time.Then answer.", "It is noon.", calls(("get_time", "{}")))


def test_unknown_tool_is_content():
    text = "<tool_call>launch_rockets<arg_key>n</arg_key><arg_value>3</arg_value></tool_call> done"
    assert parse(text) == ParsedOutput(None, text, [])


def test_unknown_tool_inside_reasoning_stays_reasoning():
    text = "<tool_call>nope</tool_call>hmm</think>ok"
    assert parse(text, reasoning_open=True) == ParsedOutput("<tool_call>nope</tool_call>hmm", "ok", [])


def test_literal_tool_call_in_prose_does_not_hold_text():
    parser = OutputParser(TOOLS, False, id_factory=ids())
    assert parser.feed("Use <tool_call> tags") == [ContentText("Use "), ContentText("<tool_call>"), ContentText(" tags")]


def test_without_tools_markup_is_content():
    text = "<tool_call>get_time</tool_call>"
    assert parse(text, tools=None) == ParsedOutput(None, text, [])
    assert parse(text, tools=[]) == ParsedOutput(None, text, [])


@pytest.mark.parametrize(("text", "expected"), [
    # text between pairs
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>oops"
     "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
     ParsedOutput(None, "oops<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
                  calls(("get_weather", '{"city": "Paris"}')))),
    # a key without </arg_key>
    ("<tool_call>get_weather<arg_key>city<arg_value>Paris</arg_value></tool_call>",
     ParsedOutput(None, "<arg_key>city<arg_value>Paris</arg_value></tool_call>", calls(("get_weather", "{}")))),
    # text between key and value
    ("<tool_call>get_weather<arg_key>days</arg_key>=<arg_value>2</arg_value></tool_call>",
     ParsedOutput(None, "<arg_key>days</arg_key>=<arg_value>2</arg_value></tool_call>", calls(("get_weather", "{}")))),
    # garbage after the name
    ("<tool_call>get_weather now</tool_call>", ParsedOutput(None, "<tool_call>get_weather now</tool_call>", [])),
    ("<tool_call>get_weather</think></tool_call>", ParsedOutput(None, "<tool_call>get_weather</think></tool_call>", [])),
    # nested call start: the first is bad, the second is parsed
    ("<tool_call>oops<tool_call>get_time</tool_call>",
     ParsedOutput(None, "<tool_call>oops", calls(("get_time", "{}")))),
])
def test_malformed_blocks(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("<tool_call>get_wea", ParsedOutput(None, "<tool_call>get_wea", [])),
    ("<tool_call>get_weather", ParsedOutput(None, "<tool_call>get_weather", [])),
    ("<tool_call>get_weather<arg_key>ci", ParsedOutput(None, "<arg_key>ci", calls(("get_weather", "{}")))),
    ("<tool_call>get_weather<arg_key>city</arg_key>",
     ParsedOutput(None, "<arg_key>city</arg_key>", calls(("get_weather", "{}")))),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",
     ParsedOutput(None, None, calls(("get_weather", '{"city": "Par"}')))),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par</arg_",
     ParsedOutput(None, None, calls(("get_weather", '{"city": "Par</arg_"}')))),
    ("<tool_call>get_weather<arg_key>days</arg_key><arg_value>1",
     ParsedOutput(None, None, calls(("get_weather", '{"days": 1}')))),
    ("<tool_call>get_weather<arg_key>days</arg_key><arg_value>1</arg_value>\n",
     ParsedOutput(None, None, calls(("get_weather", '{"days": 1}')))),
    ('<tool_call>get_weather{"city": "Pa', ParsedOutput(None, '{"city": "Pa', calls(("get_weather", "{}")))),
    ("<think>plan<tool_call>get_time", ParsedOutput("plan<tool_call>get_time", None, [])),
])
def test_unterminated_blocks(text, expected):
    assert parse(text) == expected


FORCED = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
          "<arg_key>days</arg_key><arg_value>3</arg_value>\n</tool_call>")


@pytest.mark.parametrize(("text", "expected"), [
    ("<tool_call>get_wea", ParsedOutput(None, None, [])),
    ("<tool_call>get_weather", ParsedOutput(None, None, calls(("get_weather", "{}")))),
    ("<tool_call>get_weather\n", ParsedOutput(None, None, calls(("get_weather", "{}")))),
    ("<tool_call>get_weather\n<arg_key>", ParsedOutput(None, None, calls(("get_weather", "{}")))),
    ("<tool_call>get_weather<arg_key>city</arg_key>\n<arg_val", ParsedOutput(None, None, calls(("get_weather", "{}")))),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par", ParsedOutput(None, None, calls(("get_weather", '{"city": "Par"}')))),
    ('<tool_call>get_weather{"city": "Pa', ParsedOutput(None, None, calls(("get_weather", "{}")))),
    ("<tool_call>get_time</tool_call><tool_call>get_weather<arg_key>da",
     ParsedOutput(None, None, calls(("get_time", "{}"), ("get_weather", "{}")))),
])
def test_a_forced_call_cut_short_leaves_no_markup_in_the_content(text, expected):
    assert parse_output(text, TOOLS, False, id_factory=ids(), forced_call=True) == expected


def test_a_forced_call_cut_anywhere_is_the_call_so_far_streamed_or_not():
    for cut in range(len("<tool_call>get_weather"), len(FORCED) + 1):
        whole = parse_output(FORCED[:cut], TOOLS, False, id_factory=ids(), forced_call=True)
        assert whole.content is None and whole.reasoning is None, cut
        assert [c.name for c in whole.tool_calls] == ["get_weather"], cut
        arguments = json.loads(whole.tool_calls[0].arguments)
        assert set(arguments) <= {"city", "days"} and str(arguments.get("city", "Paris")) in "Paris", cut
        parser = OutputParser(TOOLS, False, id_factory=ids(), forced_call=True)
        streamed = [e for ch in FORCED[:cut] for e in parser.feed(ch)] + parser.finish()
        assert collect(streamed) == whole, cut
    assert json.loads(parse_output(FORCED, TOOLS, False, forced_call=True).tool_calls[0].arguments) == {"city": "Paris", "days": 3}


SPLIT_CASES = [
    ("<think>Plan: call <tool_call>get_time</tool_call> first.</think>\nSure <b>x</b> a<b "
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> São \"P\" \\n\n</arg_value>\n"
     "<arg_key>days</arg_key><arg_value>4</arg_value>\n</tool_call><tool_call>run{\"cmd\": \"ls\"}</tool_call>"
     "<tool_call>bogus</tool_call> tail </thi <tool_", False),
    ("reason <tool_call>run<arg_key>env</arg_key><arg_value>{\"a\": [1, 2]}</arg_value>"
     "<arg_key>note</arg_key><arg_value>null</arg_value></tool_call>more</think>done", True),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par</arg_value>junk<arg_key>", False),
]


@pytest.mark.parametrize(("text", "reasoning_open"), SPLIT_CASES)
def test_every_split_position_gives_the_same_result(text, reasoning_open):
    whole = parse(text, reasoning_open=reasoning_open)
    for cut in range(len(text) + 1):
        assert collect(stream([text[:cut], text[cut:]], reasoning_open=reasoning_open)) == whole, cut
    assert collect(stream(list(text), reasoning_open=reasoning_open)) == whole


def test_split_case_result():
    text, reasoning_open = SPLIT_CASES[0]
    assert parse(text, reasoning_open=reasoning_open) == ParsedOutput(
        "Plan: call  first.",
        "\nSure <b>x</b> a<b <tool_call>bogus</tool_call> tail </thi <tool_",
        calls(("get_time", "{}"), ("get_weather", '{"city": " São \\"P\\" \\\\n\\n", "days": 4}'),
              ("run", '{"cmd": "ls"}')))


def test_plain_text_is_not_held_back():
    parser = OutputParser(TOOLS, True, id_factory=ids())
    assert parser.feed("a <b> c") == [ReasoningText("a <b> c")]
    assert parser.feed(" x </t") == [ReasoningText(" x ")]
    assert parser.feed("able>") == [ReasoningText("</table>")]
    assert parser.feed("</think>hi <") == [ContentText("hi ")]
    assert parser.finish() == [ContentText("<")]


def test_start_holds_only_a_possible_think():
    parser = OutputParser(None, False)
    assert parser.feed("\n <th") == []
    assert parser.feed("ey") == [ContentText("\n <they")]


def test_events_are_well_formed_around_calls():
    events = stream(["<tool_call>get_time</tool_call>x<tool_call>get_weather<arg_key>days</arg_key><arg_value>2",
                     "</arg_value></tool_call>"])
    assert events == [
        ToolCallBegin(0, "call_0", "get_time"), ToolCallArguments(0, "{"), ToolCallArguments(0, "}"), ToolCallEnd(0),
        ContentText("x"),
        ToolCallBegin(1, "call_1", "get_weather"), ToolCallArguments(1, "{"), ToolCallArguments(1, '"days": 2'),
        ToolCallArguments(1, "}"), ToolCallEnd(1),
    ]


def test_feed_after_finish_is_an_error():
    parser = OutputParser(None, False)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_round_trip_through_the_builtin_template():
    arguments = {"cmd": "  echo '<hi>'\n", "timeout": 1.5, "verbose": False, "env": {"A": "x"},
                 "args": ["a", "b"], "note": None, "anything": [1, {"k": True}]}
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"id": "a", "type": "function",
                               "function": {"name": "run", "arguments": json.dumps(arguments)}}]}
    text = ChatTemplate.builtin().render([message], add_generation_prompt=False).text
    output = text.removeprefix("[gMASK]<sop><|assistant|><think></think>")
    result = parse(output)
    assert result.content is None
    assert json.loads(result.tool_calls[0].arguments) == arguments


# Property: any output, chunked any way, streams to exactly what one-shot parsing gives.

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
NAMES = ["get_weather", "get_time", "run", "get", "weather", "run_x"]
KEYS = ["city", "days", "cmd", "timeout", "verbose", "env", "args", "note", "mode", "anything", "other"]

plain = st.text(alphabet=st.sampled_from(list("ab <>/{}\"\\\n\t:é😀_")), max_size=12)
partial_marker = st.sampled_from(MARKERS).flatmap(lambda m: st.integers(1, len(m)).map(lambda n: m[:n]))
value_text = st.one_of(plain, st.sampled_from(
    ["1", "2.5", "true", "null", "[1, 2]", '{"a": 1}', "  x  ", "NaN", "-1e999", '["\\udc00"]']))


@st.composite
def tool_call(draw):
    name = draw(st.sampled_from(NAMES))
    pairs = draw(st.lists(st.tuples(st.sampled_from(KEYS), value_text), max_size=3))
    gap = st.sampled_from(["", "\n", " "])
    body = "".join(f"{draw(gap)}<arg_key>{key}</arg_key>{draw(gap)}<arg_value>{value}</arg_value>"
                   for key, value in pairs)
    if draw(st.booleans()) and not pairs:
        body = draw(st.sampled_from(['{"city": "x"}', '\n{"days": 2, "x": [1]}', "{bad", ">{}", '{"a": NaN}']))
    text = f"<tool_call>{draw(gap)}{name}{body}{draw(gap)}</tool_call>"
    if draw(st.booleans()):  # break it: cut it short or splice in junk
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.one_of(st.just(""), plain, partial_marker))
    return text


fragment = st.one_of(plain, partial_marker, st.sampled_from(MARKERS), tool_call(),
                     plain.map(lambda t: f"<think>{t}</think>"))


def chunked(text, sizes):
    chunks, position = [], 0
    for size in itertools.cycle(sizes):
        if position >= len(text):
            return chunks
        chunks.append(text[position:position + size])
        position += size


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(fragment, max_size=8), sizes=st.lists(st.integers(1, 7), min_size=1, max_size=6),
       reasoning_open=st.booleans(), with_tools=st.booleans())
def test_streaming_matches_one_shot(parts, sizes, reasoning_open, with_tools):
    text = "".join(parts)
    tools = TOOLS if with_tools else None
    whole = parse(text, tools=tools, reasoning_open=reasoning_open)
    events = stream(chunked(text, sizes), tools=tools, reasoning_open=reasoning_open)
    assert collect(events) == whole
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
        call.arguments.encode("utf-8")
    open_calls = set()
    for event in events:
        if isinstance(event, ToolCallBegin):
            open_calls.add(event.index)
        elif isinstance(event, ToolCallArguments):
            assert event.index in open_calls
        elif isinstance(event, ToolCallEnd):
            open_calls.remove(event.index)
        else:
            assert event.text and not open_calls
    assert not open_calls
    if not with_tools:
        assert whole == reasoning_oracle(text, reasoning_open)


def reasoning_oracle(text, reasoning_open):
    """Without tools the split is simple enough to state directly: nothing but the think markers is lost."""
    if not reasoning_open:
        if not text.lstrip().startswith("<think>"):
            return ParsedOutput(None, text if text.strip() else None, [])
        text = text.lstrip().removeprefix("<think>")
    reasoning, _, content = text.partition("</think>")
    return ParsedOutput(reasoning if reasoning.strip() else None, content if content.strip() else None, [])
