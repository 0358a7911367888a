"""One access-log line per request, over real gunicorn + gevent with the scripted model: counts and timings,
no prompt or completion text unless GLM53_LOG_PROMPTS asks for it, never the API key."""

from __future__ import annotations

import re
import time

import pytest

from tests import loadgen

from .servers import Server

SECRET_PROMPT = "[[script:plain]] my card number is 4111-1111"
ANSWER = "Hello there, friend."
KEY = "sk-access-log-test"


def access_lines(server: Server, path: str) -> list[str]:
    deadline = time.monotonic() + 5  # a stream is logged once its response is closed
    while True:
        lines = [line for line in server.log().splitlines() if "glm53.access:" in line and f" {path} " in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@pytest.mark.parametrize("log_prompts", [False, True])
def test_access_log_line_per_request_with_text_only_when_asked(log_prompts):
    env = {"GLM53_API_KEY": KEY, **({"GLM53_LOG_PROMPTS": "1"} if log_prompts else {})}
    s = Server(["-cs", "4096"], env=env, module="tests.server.scripted_server").wait_ready()
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"messages": [{"role": "user", "content": SECRET_PROMPT}], "chat_template_kwargs": {"enable_thinking": False}}
        code, resp = s.post("/v1/chat/completions", body, auth)
        assert code == 200 and resp["choices"][0]["message"]["content"] == ANSWER
        code, _ = s.post("/v1/completions", {"prompt": SECRET_PROMPT, "stream": True}, auth)
        assert code == 200
        assert loadgen.request(s.port, "POST", "/tokenize", {"text": SECRET_PROMPT}).status == 401  # no key
        chat = access_lines(s, "/v1/chat/completions")
        streamed = access_lines(s, "/v1/completions")
        refused = access_lines(s, "/tokenize")
    finally:
        log = s.stop()
    assert len(chat) == 1 and len(streamed) == 1 and len(refused) == 1
    prompt_tokens = resp["usage"]["prompt_tokens"]
    assert re.search(rf"POST /v1/chat/completions 200 prompt_tokens={prompt_tokens} completion_tokens=21 ttft_ms=[\d.]+ total_ms=[\d.]+ finish=stop", chat[0])
    assert re.search(r"POST /v1/completions 200 prompt_tokens=\d+ completion_tokens=21 ttft_ms=[\d.]+ total_ms=[\d.]+ finish=stop", streamed[0])
    assert re.search(r"POST /tokenize 401 total_ms=[\d.]+$", refused[0])
    assert KEY not in log and "Bearer" not in log
    if log_prompts:
        assert "4111-1111" in chat[0] and f'completions=["{ANSWER}"]' in chat[0] and f'completions=["{ANSWER}"]' in streamed[0]
    else:
        assert "4111-1111" not in log and ANSWER not in log and "prompts=" not in log
