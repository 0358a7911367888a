import copy
import json

import pytest

from glm53.models.chat_template import ChatTemplate, RenderedPrompt, TemplateError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", '
                '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}')
TOOLS_BLOCK = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + WEATHER_JSON
    + "\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)


@pytest.fixture
def builtin():
    return ChatTemplate.builtin()


def test_builtin_system_and_user(builtin):
    prompt = builtin.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert prompt == RenderedPrompt(text="[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|><think>",
                                    thinking_open=True)
    assert builtin.origin == "built-in GLM-5"


def test_builtin_tool_history(builtin):
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "\nTwo cities.\n",
         "tool_calls": [
             {"id": "a", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "hourly": true}'}},
             {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
         ]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "rain"}]},
        {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
        {"role": "user", "content": "Thanks"},
    ]
    prompt = builtin.render(messages, [WEATHER])
    assert prompt.text == (
        "[gMASK]<sop>" + TOOLS_BLOCK
        + "<|user|>Weather in Paris and Rome?"
        + "<|assistant|><think></think>Checking."
        + "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        + "<arg_key>days</arg_key><arg_value>2</arg_value><arg_key>hourly</arg_key><arg_value>true</arg_value></tool_call>"
        + "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"
        + "<|observation|><tool_response>sunny</tool_response><tool_response>rain</tool_response>"
        + "<|assistant|><think></think>Sunny in Paris, rain in Rome."
        + "<|user|>Thanks<|assistant|><think>"
    )


def test_reasoning_kept_only_after_last_user(builtin):
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": None, "reasoning_content": "new thoughts",
         "tool_calls": [{"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "noon"},
    ]
    assert builtin.render(messages).text == (
        "[gMASK]<sop><|user|>Q1<|assistant|><think></think>A1<|user|>Q2"
        "<|assistant|><think>new thoughts</think><tool_call>get_time</tool_call>"
        "<|observation|><tool_response>noon</tool_response><|assistant|><think>"
    )


def test_inline_reasoning_in_assistant_content_is_split(builtin):
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "<think>\nhidden\n</think>\n\nAnswer"}]
    text = builtin.render(messages, add_generation_prompt=False).text
    assert text == "[gMASK]<sop><|user|>Q<|assistant|><think>hidden</think>Answer"


def test_thinking_off_gives_empty_think_block(builtin):
    prompt = builtin.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert prompt == RenderedPrompt(text="[gMASK]<sop><|user|>Hi<|assistant|><think></think>", thinking_open=False)


def test_no_generation_prompt(builtin):
    prompt = builtin.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert prompt == RenderedPrompt(text="[gMASK]<sop><|user|>Hi", thinking_open=False)


@pytest.mark.parametrize(("effort", "line"), [
    ("minimal", "Low"), ("low", "Low"), ("medium", "High"), ("high", "High"), ("max", "Max"),
])
def test_reasoning_effort_line(builtin, effort, line):
    text = builtin.render([{"role": "user", "content": "Hi"}], reasoning_effort=effort).text
    assert text == f"[gMASK]<sop><|system|>Reasoning Effort: {line}<|user|>Hi<|assistant|><think>"


def test_reasoning_effort_none_adds_nothing(builtin):
    text = builtin.render([{"role": "user", "content": "Hi"}], reasoning_effort=None).text
    assert text == "[gMASK]<sop><|user|>Hi<|assistant|><think>"


def test_reasoning_effort_after_tools_block(builtin):
    text = builtin.render([{"role": "user", "content": "Hi"}], [WEATHER], reasoning_effort="low").text
    assert text == "[gMASK]<sop>" + TOOLS_BLOCK + "<|system|>Reasoning Effort: Low<|user|>Hi<|assistant|><think>"


def test_unknown_reasoning_effort_is_a_template_error(builtin):
    with pytest.raises(TemplateError, match="reasoning_effort must be one of"):
        builtin.render([{"role": "user", "content": "Hi"}], reasoning_effort="extreme")


def test_empty_tools_list_renders_no_tools_block(builtin):
    assert builtin.render([{"role": "user", "content": "Hi"}], []).text == "[gMASK]<sop><|user|>Hi<|assistant|><think>"


def test_developer_is_system_and_parts_are_joined(builtin):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Rule "}, {"type": "text", "text": "one"}]},
                {"role": "user", "content": None}]
    assert builtin.render(messages).text == "[gMASK]<sop><|system|>Rule one<|user|><|assistant|><think>"


def test_non_text_part_is_a_template_error(builtin):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(TemplateError, match="'image_url'"):
        builtin.render(messages)


@pytest.mark.parametrize("arguments", ['{"city": ', '[1, 2]', '"Paris"'])
def test_arguments_not_a_json_object_name_the_message(builtin, arguments):
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "a", "type": "function",
                                 "function": {"name": "get_weather", "arguments": arguments}}]}]
    with pytest.raises(TemplateError, match=r"messages\[1\]"):
        builtin.render(messages)


def test_arguments_string_becomes_object_without_mutating_caller(builtin):
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "a", "type": "function",
                         "function": {"name": "f", "arguments": '{"n": 1.5, "s": "x y", "l": [1, "a"], "o": {"k": null}}'}}]},
    ]
    before = copy.deepcopy(messages)
    text = builtin.render(messages).text
    assert messages == before
    assert text == (
        "[gMASK]<sop><|system|>sys<|user|>Q<|assistant|><think></think><tool_call>f"
        '<arg_key>n</arg_key><arg_value>1.5</arg_value><arg_key>s</arg_key><arg_value>x y</arg_value>'
        '<arg_key>l</arg_key><arg_value>[1, "a"]</arg_value><arg_key>o</arg_key><arg_value>{"k": null}</arg_value>'
        "</tool_call><|assistant|><think>"
    )


def test_unknown_role_is_a_template_error(builtin):
    with pytest.raises(TemplateError, match="Unsupported message role: robot"):
        builtin.render([{"role": "robot", "content": "beep"}])


def test_messages_must_be_objects(builtin):
    with pytest.raises(TemplateError, match=r"messages\[0\] is not an object"):
        builtin.render(["hello"])


def _write(directory, name, text):
    (directory / name).write_text(text, encoding="utf-8")


def test_checkpoint_jinja_file_wins(tmp_path):
    _write(tmp_path, "chat_template.jinja", "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    _write(tmp_path, "tokenizer_config.json", json.dumps({
        "chat_template": "ignored", "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.origin == "checkpoint chat_template.jinja"
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
    assert template.render([{"role": "user", "content": "hi"}]).text == "<s>[user]hi"


def test_checkpoint_tokenizer_config_string(tmp_path):
    _write(tmp_path, "tokenizer_config.json", json.dumps({
        "chat_template": "{{ messages[0].content }}|{{ eos_token }}|{{ tools | tojson }}", "eos_token": "<|endoftext|>"}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.origin == "checkpoint tokenizer_config.json"
    assert template.render([{"role": "user", "content": "hi"}]).text == "hi|<|endoftext|>|null"


def test_checkpoint_tokenizer_config_list_uses_tool_use_with_tools(tmp_path):
    _write(tmp_path, "tokenizer_config.json", json.dumps({"chat_template": [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools[0].function.name }}:{{ messages[0].content }}"},
    ]}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.render([{"role": "user", "content": "hi"}]).text == "plain:hi"
    assert template.render([{"role": "user", "content": "hi"}], [WEATHER]).text == "tools:get_weather:hi"


def test_checkpoint_tokenizer_config_list_without_default(tmp_path):
    _write(tmp_path, "tokenizer_config.json", json.dumps({"chat_template": [{"name": "rag", "template": "x"}]}))
    with pytest.raises(TemplateError, match="no 'default' template"):
        ChatTemplate.from_model_dir(tmp_path)


def test_checkpoint_without_template_uses_builtin(tmp_path):
    _write(tmp_path, "tokenizer_config.json", json.dumps({"eos_token": "<|endoftext|>"}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.origin == "built-in GLM-5"
    assert template.eos_token == "<|endoftext|>"
    assert template.render([{"role": "user", "content": "Hi"}]).text == "[gMASK]<sop><|user|>Hi<|assistant|><think>"


def test_think_closed_for_a_template_that_ignores_enable_thinking():
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<a><think>", "test")
    on = template.render([{"role": "user", "content": "q"}])
    off = template.render([{"role": "user", "content": "q"}], enable_thinking=False)
    assert on == RenderedPrompt(text="<user>q<a><think>", thinking_open=True)
    assert off == RenderedPrompt(text="<user>q<a><think></think>", thinking_open=False)


def test_template_variables_and_globals():
    source = ("{{ enable_thinking }}|{{ add_generation_prompt }}|{{ reasoning_effort }}|"
              "{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=True, separators=(',', ':')) }}|{{ strftime_now('%Y') | length }}")
    template = ChatTemplate(source, "test")
    text = template.render([], enable_thinking=False, add_generation_prompt=False, reasoning_effort="low").text
    assert text == 'False|False|low|{"a":"é","b":1}|4'


def test_raise_exception_is_a_template_error():
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate.') }}", "test")
    with pytest.raises(TemplateError, match="^Conversation roles must alternate.$"):
        template.render([{"role": "user", "content": "q"}])


def test_runtime_error_is_a_template_error():
    template = ChatTemplate("{{ messages[0].content.upper() }}{{ messages[5].content.upper() }}", "test origin")
    with pytest.raises(TemplateError, match="test origin chat template cannot render"):
        template.render([{"role": "user", "content": "q"}])


def test_sandbox_refuses_mutation():
    template = ChatTemplate("{{ messages.append(1) }}", "test")
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "q"}])


def test_compile_error_names_the_origin():
    with pytest.raises(TemplateError, match="The my checkpoint chat template does not compile"):
        ChatTemplate("{% for m in messages %}", "my checkpoint")
