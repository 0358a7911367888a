"""A real gunicorn + gevent server whose model is scripted, so tests know exactly what it will say.

The last ``[[script:NAME]]`` marker in the prompt picks the output from SCRIPTS (default: a plain answer);
``[[script:fail]]`` makes the backend's step raise while that sequence is active.
Run: ``python -m tests.server.scripted_server [setting flags]``.
"""

from __future__ import annotations

import re
import sys

from glm53 import config
from glm53.server.gunicorn_app import serve
from tests.fakes import ScriptedBackend

SCRIPTS = {
    "plain": "Hello there, friend.",
    "think": "Let me think about it.</think>The answer is 4.",
    "weather": (
        "I should look it up.</think>"
        '<tool_call>get_weather<arg_key>city</arg_key><arg_value> New York\n</arg_value>'
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    ),
    "two_calls": (
        "</think><tool_call>get_time</tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    ),
    "call_in_think": "Checking<tool_call>get_time</tool_call> done.</think>Here.",
    "unknown_tool": "</think><tool_call>launch_rockets<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>",
    "stop_demo": "alpha beta STOP gamma",
    "unicode": "</think>Grüße, 世界 😀!",
    "forced": "<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
}


class FailingBackend(ScriptedBackend):
    def step(self):
        if any(queue and queue[0] == -2 for queue in self.seqs.values()):
            raise RuntimeError("injected engine failure")
        return super().step()


def script(prompt_ids: list[int]) -> list[int]:
    text = bytes(i for i in prompt_ids if i < 256).decode(errors="replace")
    names = re.findall(r"\[\[script:(\w+)\]\]", text)
    name = names[-1] if names else "plain"
    if name == "fail":
        return [65, -2] + [65] * 50  # -2 marks the failure point; the step that reaches it raises
    return list(SCRIPTS[name].encode())


def main() -> None:
    settings = config.load(sys.argv[1:])
    serve(settings, backend_factory=lambda: FailingBackend(script=script, max_batch_size=settings.max_batch_size, context_length=settings.cache_size))


if __name__ == "__main__":
    main()
