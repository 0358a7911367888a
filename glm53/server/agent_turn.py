"""One assistant turn for the agents' APIs (``/v1/messages``, ``/v1/responses``): a request translated into a chat
completions request runs over the same plan (chat template, tools, forced tool calls), jobs, scheduler and output
parser as ``/v1/chat/completions``, and comes back as block events (``blocks.py``) for each API to render.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from flask import request
from pydantic import ValidationError

from ..engine.interface import Delta, Finish
from .blocks import Block, BlockEvent, Blocks, BlockStop
from .chat import ChatPlan, generation_requests, plan_chat
from .errors import APIError
from .jobs import JobGroup, runtime
from .parsing import OutputParser
from .protocol import ChatCompletionRequest
from .responses import engine_failure

# Reasoning travels back to the client inside an opaque field (Anthropic's thinking ``signature``, the Responses
# API's ``encrypted_content``) so that a client that shows no reasoning still returns it with the history: the
# chat template then renders the earlier turn as it was generated, and its cached tokens are reused.
OPAQUE_PREFIX = "glm53.r1."


def seal_reasoning(text: str) -> str:
    return OPAQUE_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()


def unseal_reasoning(sealed: str | None) -> str | None:
    """The reasoning inside a value made by ``seal_reasoning``; None for any other value (another server's)."""
    if not sealed or not sealed.startswith(OPAQUE_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(sealed[len(OPAQUE_PREFIX):].encode()).decode()
    except ValueError:
        return None


def chat_request(body: dict, fields: dict[str, str]) -> ChatCompletionRequest:
    """A chat completions request built from a translated body.

    :param fields: chat field -> the field of the caller's API it came from, to name in an error.
    :raise 400: a translated value the chat request refuses (named as the caller's field).
    """
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        chat_field = str(err["loc"][0]) if err["loc"] else ""
        param = fields.get(chat_field, chat_field) or None
        message = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param, code=err["type"]) from None


def renamed(err: APIError, params: Sequence[tuple[str, str]]) -> APIError:
    """``err`` with its ``param`` (and the message's leading copy of it) under the first rule that matches."""
    for pattern, replacement in params:
        if err.param is not None and re.fullmatch(pattern, err.param):
            param = re.sub(pattern, replacement, err.param)
            message = param + err.message[len(err.param):] if err.message.startswith(err.param) else err.message
            return APIError(err.status, message, param=param, code=err.code, headers=err.headers)
    return err


@dataclass(frozen=True)
class Started:
    """The job's first output arrived (its prompt is prefilled)."""

    cached_tokens: int


class Turn:
    """The jobs of one translated request, submitted on construction.

    :raise 400: the prompt cannot be rendered or leaves no room. :raise 429: queue full. :raise 503: not ready.
    """

    def __init__(self, req: ChatCompletionRequest, id_factory: Callable[[], str], params: Sequence[tuple[str, str]] = ()):
        """:param params: (regular expression, replacement) rules that turn the name of a chat field in a 400 of the
            plan (a schema the grammar cannot hold, a tool's parameters) into the caller's API's field."""
        self.req = req
        try:
            self.plan: ChatPlan = plan_chat(req)
        except APIError as err:
            raise renamed(err, params) from None
        self.group = JobGroup(generation_requests(req, self.plan), request.environ)
        self.tokenizer = runtime().backend.tokenizer  # the stream runs outside the app context
        self._id_factory = id_factory

    @property
    def prompt_tokens(self) -> int:
        return len(self.plan.prompt_ids)

    def events(self, keepalive_s: float | None) -> Iterator[None | Started | BlockEvent | Finish]:
        """None while idle for ``keepalive_s``; ``Started`` once; block events; the ``Finish`` last (one that ended
        in error or was cancelled comes without closing the blocks). Closing the iterator cancels the job."""
        parser = OutputParser(self.plan.tools, self.plan.reasoning_open, self._id_factory, forced_call=bool(self.plan.prefix))
        blocks = Blocks()
        started = False
        try:
            for item in self.group.events(keepalive_s):
                if item is None:
                    yield None
                    continue
                ev = item[1]
                if not started:
                    started = True
                    yield Started((ev.cached_tokens or 0) if isinstance(ev, Delta) else ev.cached_tokens)
                    yield from blocks.feed(parser.feed(self.plan.prefix))
                if isinstance(ev, Delta):
                    yield from blocks.feed(parser.feed(ev.text))
                    continue
                if ev.reason not in ("error", "cancelled"):
                    yield from blocks.feed(parser.finish())
                    yield from blocks.close()
                yield ev
        finally:
            self.group.close()

    def collect(self) -> tuple[list[Block], Finish]:
        """The whole answer. :raise 500: the engine failed. :raise 503: the job was cancelled."""
        blocks: list[Block] = []
        finish = None
        for ev in self.events(None):
            if isinstance(ev, Finish):
                finish = ev
            elif isinstance(ev, BlockStop):
                blocks.append(ev.block)
        if finish.reason in ("error", "cancelled"):
            raise engine_failure(finish)
        return blocks, finish
