"""A real gunicorn + gevent server whose model is scripted, so tests know exactly what it will say (the same model
serves the in-process apps of ``tests.server.apps``).

The last ``[[script:NAME]]`` marker in the prompt picks the output from SCRIPTS (default: a plain answer);
``[[script:fail]]`` makes the backend's step raise while that sequence is active (the whole batch fails);
``[[script:fail_alone]]`` fails that sequence alone after two tokens; ``[[script:slow_prefill]]`` spends
PREFILL_STEPS steps prefilling; ``[[script:long]]`` writes LONG_TOKENS tokens. ``[[cached:N]]`` makes the first
token report N prompt tokens served from a prefix cache. An agent script (AGENT_CALLS) plays one tool-use turn:
until a tool result follows its marker it calls its tool, then it answers with that result.
Run: ``python -m tests.server.scripted_server [setting flags]``; ``SCRIPTED_STEP_S`` in the environment makes each
engine step take that many seconds (so a test can act while a job is in a given phase); ``SCRIPTED_OFFLOAD=1`` adds
the offload figures of a recorded GPU run to ``/stats`` (:func:`recorded_offload`), for the built-in page's dashboard.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from functools import cache
from pathlib import Path

from glm53 import config
from glm53.server.gunicorn_app import serve
from tests.fakes import FAIL_ALONE, PREFILL, ByteTokens, ScriptedBackend

PREFILL_STEPS = 100
LONG_TOKENS = 2000

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
    # markup that a page must show as text; and Markdown it should render
    "html": (
        "</think>Look: <script>window.injected = 1</script> and <img src=x onerror=\"window.injected = 2\">.\n\n"
        "A **bold** claim, `code`, [a link](javascript:alert(1)).\n\n```html\n<b>not bold</b>\n```\n"
    ),
}

# Agent scripts: the tool called and its arguments. The command's output (glm53-42) differs from its text, so an
# answer that quotes it shows that the client really ran the command and sent the result back.
AGENT_COMMAND = "echo glm53-$((6*7))"
AGENT_CALLS = {
    "claude_bash": ("Bash", {"command": AGENT_COMMAND, "description": "Print a number"}),
    "codex_exec": ("exec_command", {"cmd": AGENT_COMMAND}),
    "agent_weather": ("get_weather", {"city": "Oslo"}),
}
AGENT_ANSWER = "The tool said: "


def agent_turn(prompt: str, tool: str, args: dict[str, str]) -> str:
    """The output of one step of a tool-use loop: a call to ``tool``, or, once a tool result follows the script's
    marker, an answer quoting the last result (each after a short reasoning when the prompt opened one)."""
    results = re.findall(r"<tool_response>(.*?)</tool_response>", prompt[prompt.rfind("[[script:"):], re.S)
    think = prompt.rstrip().endswith("<think>")
    if results:
        return ("Reading the result.</think>" if think else "") + AGENT_ANSWER + results[-1].strip()
    pairs = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return ("Calling the tool.</think>" if think else "") + f"<tool_call>{tool}{pairs}</tool_call>"


class FailingBackend(ScriptedBackend):
    def step(self):
        if any(queue and queue[0] == -2 for queue in self.seqs.values()):
            raise RuntimeError("injected engine failure")
        return super().step()


# An H200 run of fast mode on the scaled synthetic checkpoint (12 MoE layers) with the link emulated at 25 GB/s:
# the expert cache per layer, the CPU tier's split, the measured link, VRAM and pinned host RAM as /stats shows them.
RECORDED_RUN = Path(__file__).resolve().parents[2] / "bench/results/2026-12-02-h200-link-emulated-25-stock-mcs.json"
SCALED = {"picks", "hits", "misses", "admissions", "evictions", "cpu_experts", "cpu_picks"}


@cache
def _recorded_fast_arm() -> dict:
    arm = next(a for a in json.loads(RECORDED_RUN.read_text())["arms"] if a["name"] == "fast")
    return arm["engine_stats"]


def recorded_offload(steps: int) -> dict:
    """The recorded run's memory and offload figures, its counters scaled from the run's decode steps to ``steps``
    (so they grow while this server decodes, at the recorded rates)."""
    stats = _recorded_fast_arm()
    offload = stats["offload"]
    scale = steps / offload["cache"]["decode_steps"]

    def scaled(figures: dict) -> dict:
        return {k: round(v * scale) if k in SCALED else v for k, v in figures.items()}

    cache_figures = {**scaled(offload["cache"]), "decode_steps": steps,
                     "per_layer": [scaled(layer) for layer in offload["cache"]["per_layer"]]}
    cpu_tier = {**offload["cpu_tier"], "split": scaled(offload["cpu_tier"]["split"])}
    return {"vram_allocated_gb": stats["vram_allocated_gb"], "vram_reserved_gb": stats["vram_reserved_gb"],
            "offload": {**offload, "cache": cache_figures, "cpu_tier": cpu_tier}}


class RecordedOffloadBackend(FailingBackend):
    def stats(self) -> dict:
        return {**super().stats(), **recorded_offload(self.steps)}


def script(prompt_ids: list[int]) -> list[int]:
    text = ByteTokens().decode(prompt_ids)  # GLM's markers are tokens of their own
    names = re.findall(r"\[\[script:(\w+)\]\]", text)
    name = names[-1] if names else "plain"
    if name == "fail":
        return [65, -2] + [65] * 50  # -2 marks the failure point; the step that reaches it raises
    if name == "fail_alone":
        return [65, 66, FAIL_ALONE]
    if name == "slow_prefill":
        return [PREFILL] * PREFILL_STEPS + list(SCRIPTS["plain"].encode())
    if name == "long":
        return [ord("x")] * LONG_TOKENS
    if name in AGENT_CALLS:
        return ByteTokens().encode(agent_turn(text, *AGENT_CALLS[name]))
    return ByteTokens().encode(SCRIPTS[name])


def cached(prompt_ids: list[int]) -> int:
    text = bytes(i for i in prompt_ids if i < 256).decode(errors="replace")
    found = re.findall(r"\[\[cached:(\d+)\]\]", text)
    return int(found[-1]) if found else 0


SCORE_LIMIT = 64  # tokens one scoring forward takes (the GPU engine's is its prefill chunk)


def backend_factory(settings: config.Settings, step_s: float = 0.0, offload: bool = False):
    """What makes the scripted model for these settings: the one this server runs, and ``tests.server.apps``'
    in-process apps; ``offload``: with a recorded GPU run's offload figures in its stats."""
    backend = RecordedOffloadBackend if offload else FailingBackend
    return lambda: backend(
        script=script, max_batch_size=settings.max_batch_size, context_length=settings.cache_size, step_seconds=step_s,
        refuse_leading_zero=False, cached=cached, max_score_tokens=SCORE_LIMIT)


def main() -> None:
    settings = config.load(sys.argv[1:])
    step_s = float(os.environ.get("SCRIPTED_STEP_S", "0"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(settings, backend_factory=backend_factory(settings, step_s, os.environ.get("SCRIPTED_OFFLOAD") == "1"))


if __name__ == "__main__":
    main()
