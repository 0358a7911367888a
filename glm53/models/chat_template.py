"""Chat prompts rendered with Hugging Face ``apply_chat_template`` semantics.

A ``ChatTemplate`` compiles one Jinja template (the checkpoint's own, or the built-in GLM-5 one in
``glm53/models/glm5_chat_template.jinja``) in the same sandboxed environment transformers uses, so a
checkpoint template renders here exactly as it does there. Messages arrive as OpenAI API dicts; they are
normalised on a copy (text parts joined, tool-call arguments parsed) because chat templates expect plain
strings and argument objects.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

BUILTIN_ORIGIN = "built-in GLM-5"
JINJA_ORIGIN = "checkpoint chat_template.jinja"
CONFIG_ORIGIN = "checkpoint tokenizer_config.json"


class TemplateError(ValueError):
    """A prompt cannot be rendered from what the client sent (the server answers 400 with the message)."""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    thinking_open: bool  # the prompt ends with <think>: generation starts inside the reasoning block


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; templates written for transformers expect this one.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile(env: ImmutableSandboxedEnvironment, source: str, origin: str) -> jinja2.Template:
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"The {origin} chat template does not compile: {exc.message} (line {exc.lineno}).") from exc


class ChatTemplate:
    """One compiled chat template (plus the optional ``tool_use`` variant some checkpoints ship).

    :param source: the Jinja source.
    :param origin: where it came from, quoted in error messages.
    :param bos_token: the tokenizer's BOS text, passed to the template as ``bos_token``.
    :param eos_token: the tokenizer's EOS text, passed to the template as ``eos_token``.
    :param tool_use_source: a second template used instead of ``source`` when tools are given.
    :raise TemplateError: a template does not compile.
    """

    def __init__(self, source: str, origin: str, bos_token: str = "", eos_token: str = "", *,
                 tool_use_source: str | None = None) -> None:
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _environment()
        self._default = _compile(env, source, origin)
        self._tool_use = _compile(env, tool_use_source, f"{origin} (tool_use)") if tool_use_source else None

    @classmethod
    def builtin(cls, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """The GLM-5 template shipped with the package."""
        source = resources.files("glm53.models").joinpath("glm5_chat_template.jinja").read_text(encoding="utf-8")
        return cls(source, BUILTIN_ORIGIN, bos_token, eos_token)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate:
        """The checkpoint's template: ``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template``, else the built-in one. BOS/EOS texts come from ``tokenizer_config.json``.

        :raise TemplateError: the checkpoint's template is unreadable or does not compile.
        """
        path = Path(path)
        config = _read_tokenizer_config(path / "tokenizer_config.json")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), JINJA_ORIGIN, bos, eos)
        if config.get("chat_template") is not None:
            default, tool_use = _pick_templates(config["chat_template"])
            return cls(default, CONFIG_ORIGIN, bos, eos, tool_use_source=tool_use)
        return cls.builtin(bos, eos)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True, enable_thinking: bool = True, **kwargs: Any) -> RenderedPrompt:
        """Render a conversation into prompt text.

        :param messages: OpenAI chat messages; never modified.
        :param tools: OpenAI tool objects, or None.
        :param add_generation_prompt: end with the assistant turn opener.
        :param enable_thinking: False gives an empty think block, even with a template that ignores the switch.
        :param kwargs: passed to the template as variables (``reasoning_effort``, ...).
        :return: the text and whether generation starts inside ``<think>``.
        :raise TemplateError: the messages cannot be rendered by this template (HTTP 400).
        """
        template = self._tool_use if tools and self._tool_use is not None else self._default
        context = {
            **kwargs,
            "messages": normalise_messages(messages),
            # An empty list means no tools: templates test `tools is not none` as often as `if tools`.
            "tools": list(tools) if tools else None,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            text = template.render(**context)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
            raise TemplateError(f"The {self.origin} chat template cannot render these messages: {exc}") from exc
        if not enable_thinking and _ends_open(text):
            text += THINK_CLOSE
        return RenderedPrompt(text=text, thinking_open=_ends_open(text))


def _ends_open(text: str) -> bool:
    return text.rstrip().endswith(THINK_OPEN)


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A copy of ``messages`` in the shape chat templates expect.

    ``developer`` becomes ``system``; content None becomes ""; a list of text parts becomes their
    concatenation; tool-call arguments given as a JSON string become an object (GLM templates iterate
    ``arguments.items()``).

    :raise TemplateError: a message is not an object, a content part is not text, or tool-call arguments
        are not a JSON object.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TemplateError("messages must be a list of message objects.")
    normalised = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"messages[{index}] is not an object.")
        message = copy.deepcopy(dict(message))
        if message.get("role") == "developer":
            message["role"] = "system"
        message["content"] = _text_content(message.get("content"), index)
        if message.get("tool_calls"):
            message["tool_calls"] = [_normalise_call(call, index) for call in message["tool_calls"]]
        else:
            # Templates test `message.tool_calls is defined`; a null or empty list means no calls.
            message.pop("tool_calls", None)
        normalised.append(message)
    return normalised


def _text_content(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateError(f"messages[{index}].content must be a string or a list of content parts.")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise TemplateError(f"messages[{index}] has a content part of type {kind!r}; only text parts are supported.")
        texts.append(part["text"])
    return "".join(texts)


def _normalise_call(call: Any, index: int) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise TemplateError(f"messages[{index}].tool_calls must be a list of objects.")
    call = dict(call)
    # OpenAI nests name/arguments under "function"; tolerate the flat shape some clients send.
    target = call
    if isinstance(call.get("function"), Mapping):
        target = call["function"] = dict(call["function"])
    arguments = target.get("arguments")
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        target["arguments"] = {}
    elif isinstance(arguments, str):
        target["arguments"] = _parse_arguments(arguments, index)
    elif not isinstance(arguments, dict):
        raise TemplateError(f"messages[{index}] has tool-call arguments that are not a JSON object.")
    return call


def _parse_arguments(text: str, index: int) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise TemplateError(f"messages[{index}] has tool-call arguments that are not a JSON object string.")
    return value


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TemplateError(f"The {CONFIG_ORIGIN} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise TemplateError(f"The {CONFIG_ORIGIN} is not a JSON object.")
    return config


def _token_text(token: Any) -> str:
    """A special token from tokenizer_config: a string or a serialised AddedToken ``{"content": ...}``."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _pick_templates(value: Any) -> tuple[str, str | None]:
    """(default, tool_use) from a ``chat_template`` that is a string or a list of named templates."""
    if isinstance(value, str):
        return value, None
    named = {}
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, Mapping)}
    if not isinstance(named.get("default"), str):
        raise TemplateError(f"The {CONFIG_ORIGIN} chat_template has no 'default' template.")
    tool_use = named.get("tool_use")
    return named["default"], tool_use if isinstance(tool_use, str) else None
