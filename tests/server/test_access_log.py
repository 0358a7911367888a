"""One access-log line per request (in-process, ``apps.py``: the log records of a fresh app over the scripted model):
counts and timings, no prompt or completion text unless GLM53_LOG_PROMPTS asks for it, never the API key. That a
client which hangs up is logged as 499 needs a real server: ``test_faults.py``."""

from __future__ import annotations

import logging
import re

import pytest

from . import apps

SECRET_PROMPT = "[[script:plain]] my card number is 4111-1111"
ANSWER = "Hello there, friend."
KEY = "sk-access-log-test"


def access_lines(caplog, path: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "glm53.access" and f" {path} " in r.getMessage()]


@pytest.mark.parametrize("log_prompts", [False, True])
def test_access_log_line_per_request_with_text_only_when_asked(log_prompts, caplog):
    caplog.set_level(logging.INFO)  # what the server's log would hold
    env = {"GLM53_API_KEY": KEY, **({"GLM53_LOG_PROMPTS": "1"} if log_prompts else {})}
    with apps.scripted(["-cs", "4096"], env) as app:
        client = app.test_client()
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"messages": [{"role": "user", "content": SECRET_PROMPT}], "chat_template_kwargs": {"enable_thinking": False}}
        r = client.post("/v1/chat/completions", json=body, headers=auth)
        resp = r.get_json()
        assert r.status_code == 200 and resp["choices"][0]["message"]["content"] == ANSWER
        assert client.post("/v1/completions", json={"prompt": SECRET_PROMPT, "stream": True}, headers=auth).status_code == 200
        assert client.post("/tokenize", json={"text": SECRET_PROMPT}).status_code == 401  # no key
    # each answer was read to its end and closed before the client returned: its line is written
    chat = access_lines(caplog, "/v1/chat/completions")
    streamed = access_lines(caplog, "/v1/completions")
    refused = access_lines(caplog, "/tokenize")
    log = caplog.text
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


def test_probes_are_logged_at_debug_and_counted_like_every_request(caplog):
    """A load balancer's or the model-loading wait's /health polls and a scraper's /metrics come several times a
    second: at INFO (the server's level) they would bury the requests."""
    caplog.set_level(logging.DEBUG, logger="glm53.access")
    with apps.scripted() as app:
        client = app.test_client()
        for _ in range(3):
            assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.post("/tokenize", json={"text": "x"}).status_code == 200
        counted = client.get("/stats").get_json()["requests"]["requests"]
    levels = {path: {r.levelname for r in caplog.records if r.name == "glm53.access" and f" {path} " in r.getMessage()}
              for path in ("/health", "/metrics", "/tokenize")}
    assert levels == {"/health": {"DEBUG"}, "/metrics": {"DEBUG"}, "/tokenize": {"INFO"}}
    assert counted["/health 200"] == 3 and counted["/metrics 200"] == 1
