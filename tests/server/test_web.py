"""The built-in page (``server/web``): its headers and caching in-process, then the page itself in a headless
Chromium against two real servers, shared by the module: the scripted model (reasoning, tool calls, markup, a long
answer; offload figures from a recorded GPU run in /stats) and the CPU demo model behind an API key."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from selenium.webdriver.common.by import By

from glm53.server.web import CSP

from . import apps, scripted_server
from .browser import chromium, console_errors, wait
from .servers import Server

KEY = "page-test-key"
STEP_S = 0.003  # the scripted model's step: its long answer (2000 tokens) runs about 6 s
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}


# ----- in-process: headers, caching, auth


def test_the_page_and_its_assets_carry_a_strict_policy_and_hashed_urls():
    with apps.scripted() as app:
        client = app.test_client()
        page = client.get("/")
        assert page.status_code == 200 and page.mimetype == "text/html"
        assert page.headers["Content-Security-Policy"] == CSP
        assert "script-src 'self'" in CSP and "default-src 'none'" in CSP and "unsafe" not in CSP
        assert page.headers["X-Content-Type-Options"] == "nosniff"
        assert page.headers["Cache-Control"] == "no-store"
        html = page.get_data(as_text=True)
        assert "<script>" not in html and " style=" not in html  # nothing inline for the policy to allow
        digest, = set(re.findall(r'/assets/([0-9a-f]{16})/', html))
        for name, kind in (("app.js", "text/javascript"), ("chat.js", "text/javascript"), ("style.css", "text/css"), ("icon.svg", "image/svg+xml")):
            asset = client.get(f"/assets/{digest}/{name}")
            assert asset.status_code == 200 and asset.mimetype == kind, name
            assert asset.headers["Cache-Control"] == "public, max-age=31536000, immutable"
            assert asset.headers["X-Content-Type-Options"] == "nosniff"
        # another version's URL must not be answered with this version's file (it would be cached for a year)
        assert client.get("/assets/0000000000000000/app.js").status_code == 404
        assert client.get(f"/assets/{digest}/missing.js").status_code == 404
        assert client.get(f"/assets/{digest}/..%2F__init__.py").status_code == 404
        icon = client.get("/favicon.ico")
        assert icon.status_code == 200 and icon.mimetype == "image/svg+xml" and icon.headers["X-Content-Type-Options"] == "nosniff"
        # the page is no API: the OpenAPI description leaves it out
        assert not {p for p in client.get("/openapi.json").get_json()["paths"] if p == "/" or p.startswith("/assets")}


def test_with_an_api_key_the_page_is_open_but_tells_nothing_of_the_model():
    with apps.scripted(env={"GLM53_API_KEY": KEY}) as app:
        client = app.test_client()
        page = client.get("/")
        html = page.get_data(as_text=True)
        assert page.status_code == 200 and '<meta name="glm53-api-key" content="required">' in html
        assert KEY not in html and "scripted" not in html
        digest = re.search(r"/assets/([0-9a-f]{16})/", html)[1]
        assert client.get(f"/assets/{digest}/app.js").status_code == 200
        assert client.get("/favicon.ico").status_code == 200
        assert client.get("/stats").status_code == 401
        assert client.get("/stats", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with apps.scripted() as app:
        assert '<meta name="glm53-api-key" content="none">' in app.test_client().get("/").get_data(as_text=True)


def test_stats_give_the_ttft_sum_and_count_and_the_process_rss():
    with apps.scripted() as app:
        client = app.test_client()
        assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        stats = client.get("/stats").get_json()
        assert stats["requests"]["ttft_count"] == 1
        assert stats["requests"]["ttft_seconds_sum"] == pytest.approx(stats["requests"]["ttft_seconds_mean"])
        assert stats["process"]["rss_bytes"] > 10e6


# ----- in a browser


@pytest.fixture(scope="module")
def servers():
    # started together: each spends a few seconds importing torch
    scripted = Server(["--max-batch-size", "4", "-cs", "8192"], env={"SCRIPTED_STEP_S": str(STEP_S), "SCRIPTED_OFFLOAD": "1"},
                      module="tests.server.scripted_server")
    tiny = Server(["serve", "--engine", "tiny", "-cs", "4096"], env={"GLM53_API_KEY": KEY})
    try:
        yield scripted.wait_ready(), tiny.wait_ready()
    finally:
        with ThreadPoolExecutor(2) as pool:  # each drains for a moment after its SIGTERM
            list(pool.map(Server.stop, (scripted, tiny)))


@pytest.fixture(scope="module")
def scripted(servers):
    return servers[0]


@pytest.fixture(scope="module")
def tiny(servers):
    return servers[1]


@pytest.fixture(scope="module")
def browser():
    with chromium() as driver:
        yield driver


def fresh(browser, server: Server, view: str = "chat", key: str | None = None):
    """The page as a first visit sees it (no chats, no settings; the key in this tab's session when given)."""
    # the storage is set from another page of the origin: a page of ours still running could write to it
    browser.get(server.url + "/health")
    browser.execute_script("localStorage.clear(); sessionStorage.clear(); if (arguments[0]) sessionStorage.setItem('glm53.apiKey', arguments[0]);", key)
    browser.get(f"{server.url}/#{view}")
    wait(browser, lambda b: b.find_element(By.ID, "views").is_displayed())
    return browser


def ask(browser, text: str) -> None:
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys(text)
    browser.find_element(By.ID, "send").click()


def last_answer(browser):
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def answer_state(browser) -> tuple[str | None, str]:
    """The last answer's state and text, read at one moment (the page redraws an answer while it streams)."""
    return tuple(browser.execute_script(
        "const a = [...document.querySelectorAll('.msg.assistant')].at(-1);"
        "return a ? [a.dataset.state, a.querySelector('.content').textContent] : [null, ''];"))


def answered(browser, timeout: float = 15.0) -> str:
    """The last answer's end state (stop, length, tool_calls, stopped, error) once it has one."""
    return wait(browser, lambda b: (state := answer_state(b)[0]) not in (None, "streaming") and state, timeout)


def long_answer(browser) -> None:
    """Ask for the scripted model's long answer, thinking off: it writes no end of reasoning, so its text would all
    be reasoning."""
    browser.find_element(By.ID, "set-thinking").click()
    ask(browser, "[[script:long]]")


def set_field(browser, name: str, value: str) -> None:
    field = browser.find_element(By.ID, f"set-{name}")
    field.clear()
    field.send_keys(value)


def test_the_page_loads_with_no_console_errors(browser, scripted):
    fresh(browser, scripted, "chat")
    assert browser.find_element(By.ID, "composer").is_displayed()
    assert browser.find_element(By.ID, "status").text == "ready"
    browser.find_element(By.ID, "tab-engine").click()
    # the dashboard has polled twice: a heatmap column needs two polls' counters
    wait(browser, lambda b: b.find_element(By.ID, "chart-tokps").get_attribute("data-points") not in (None, "", "0", "1"))
    assert "scripted" in browser.find_element(By.ID, "settings-table").text
    assert console_errors(browser) == []


def test_a_chat_turn_against_the_demo_model_streams_into_the_page_and_ends(browser, tiny):
    fresh(browser, tiny, key=KEY)
    browser.find_element(By.ID, "set-thinking").click()  # the demo model would think for all its tokens
    # enough tokens that the answer spans many of the browser's reads: 24 came in one read on a loaded 2-core machine
    # (the demo model makes them in a few milliseconds), which drew the answer in one piece
    set_field(browser, "max_tokens", "160")
    set_field(browser, "temperature", "0")  # greedy: the answer the API gives to the same request
    # every text the answer shows while it streams, as the page draws it
    browser.execute_script("""
        window.seen = [];
        new MutationObserver(() => {
          const a = [...document.querySelectorAll('.msg.assistant')].at(-1);
          if (a && a.dataset.state === 'streaming') window.seen.push(a.querySelector('.content').textContent);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    ask(browser, "Hello")
    assert answered(browser, 30) in ("length", "stop")
    answer = last_answer(browser).find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent")
    seen = [t for t in dict.fromkeys(browser.execute_script("return window.seen")) if t]
    assert answer and len(seen) >= 2, seen  # it grew in steps, not in one piece at the end
    footer = last_answer(browser).find_element(By.TAG_NAME, "footer").text
    assert re.search(r"\b\d+ tokens · [\d.]+ tok/s", footer), footer
    conversations = json.loads(browser.execute_script("return localStorage.getItem('glm53.conversations.v1')"))
    assert [m["role"] for m in conversations[0]["messages"]] == ["user", "assistant"]
    status, direct = tiny.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 160, "temperature": 0,
                                                        "chat_template_kwargs": {"enable_thinking": False}}, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and conversations[0]["messages"][1]["content"] == direct["choices"][0]["message"]["content"]
    assert answer.split() == direct["choices"][0]["message"]["content"].split()  # shown as it came (Markdown aside)
    assert console_errors(browser) == []


def test_stop_cancels_a_long_answer_and_the_server_ends_its_job(browser, scripted):
    fresh(browser, scripted)
    before = scripted.get("/stats")[1]["scheduler"]["jobs_cancelled"]
    long_answer(browser)
    wait(browser, lambda b: len(answer_state(b)[1]) >= 50)
    browser.find_element(By.ID, "stop").click()
    assert answered(browser) == "stopped"
    assert "stopped" in last_answer(browser).find_element(By.TAG_NAME, "footer").text
    assert 50 <= len(answer_state(browser)[1]) < scripted_server.LONG_TOKENS
    sched = wait(browser, lambda b: (s := scripted.get("/stats")[1]["scheduler"])["jobs_cancelled"] == before + 1 and s["active"] == 0 and s, 5)
    assert sched["jobs_cancelled"] == before + 1 and sched["active"] == 0
    assert browser.find_element(By.ID, "send").is_displayed()


def test_reasoning_and_a_tool_call_render(browser, scripted):
    fresh(browser, scripted)
    set_field(browser, "tools", json.dumps([WEATHER_TOOL]))
    ask(browser, "Weather? [[script:weather]]")
    assert answered(browser) == "tool_calls"
    answer = last_answer(browser)
    reasoning = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded once the answer is in
    reasoning.find_element(By.TAG_NAME, "summary").click()
    assert reasoning.find_element(By.CSS_SELECTOR, ".reasoning-text").text == "I should look it up."
    call, = answer.find_elements(By.CSS_SELECTOR, ".tool-call")
    assert call.find_element(By.CSS_SELECTOR, ".tool-name code").text == "get_weather"
    shown = call.find_element(By.TAG_NAME, "pre").get_attribute("textContent")
    assert shown == json.dumps({"city": " New York\n", "days": 3}, indent=2)
    assert "tool call" in answer.find_element(By.TAG_NAME, "footer").text


def test_markup_in_an_answer_shows_as_text(browser, scripted):
    fresh(browser, scripted)
    ask(browser, "[[script:html]]")
    assert answered(browser) == "stop"
    content = last_answer(browser).find_element(By.CSS_SELECTOR, ".content")
    text = content.get_attribute("textContent")
    assert "<script>window.injected = 1</script>" in text and '<img src=x onerror="window.injected = 2">' in text
    made = browser.execute_script("return [...arguments[0].querySelectorAll('*')].map(e => e.tagName.toLowerCase())", content)
    assert not {"script", "img", "a", "b"} & set(made), made
    assert {"strong", "code", "pre"} <= set(made)
    assert content.find_element(By.CSS_SELECTOR, "pre code").get_attribute("textContent") == "<b>not bold</b>"
    assert browser.execute_script("return window.injected") is None
    assert console_errors(browser) == []


def test_the_dashboard_charts_update_while_a_request_runs(browser, scripted):
    fresh(browser, scripted)
    recorded = scripted_server.recorded_offload(1)["offload"]
    long_answer(browser)
    wait(browser, lambda b: answer_state(b)[1])
    browser.find_element(By.ID, "tab-engine").click()
    chart = browser.find_element(By.ID, "chart-tokps")
    points = int(chart.get_attribute("data-points") or 0)
    # two more polls while the answer streams: each adds a point, with the decode rate of the moment
    wait(browser, lambda b: int(chart.get_attribute("data-points")) >= points + 2 and float(chart.get_attribute("data-last") or 0) > 0)
    assert answer_state(browser)[0] == "streaming"
    assert "running 1" in browser.find_element(By.ID, "chart-jobs").text
    assert int(browser.find_element(By.ID, "chart-ttft").get_attribute("data-points")) >= 1
    heatmap = browser.find_element(By.ID, "heatmap")
    assert heatmap.get_attribute("data-rows") == str(len(recorded["cache"]["per_layer"])) == "12"
    assert int(heatmap.get_attribute("data-columns")) >= 1
    assert heatmap.get_attribute("data-totals") == ",".join(str(layer["hit_rate"]) for layer in recorded["cache"]["per_layer"])
    split = browser.find_element(By.ID, "chart-split")
    link, cpu, prefetched = map(int, split.get_attribute("data-totals").split(","))
    assert int(split.get_attribute("data-bars")) >= 1 and prefetched == 0
    assert cpu / (link + cpu) == pytest.approx(8417 / 46113, abs=0.01)  # the recorded CPU tier's share of the misses
    assert "55.3 GB/s" in browser.find_element(By.ID, "link").text and "25.0 GB/s" in browser.find_element(By.ID, "link").text
    memory = browser.find_element(By.ID, "memory").text
    assert "6.49 GB" in memory and "32.6 GB" in memory  # VRAM allocated; experts in pinned RAM
    browser.find_element(By.ID, "tab-chat").click()
    browser.find_element(By.ID, "stop").click()
    assert answered(browser) == "stopped"


def test_the_demo_model_without_offload_shows_dashes(browser, tiny):
    fresh(browser, tiny, "engine", key=KEY)
    wait(browser, lambda b: "glm53-tiny" in b.find_element(By.ID, "settings-table").text)
    assert browser.find_element(By.ID, "heatmap").text.startswith("— this engine has no expert cache")
    assert browser.find_element(By.ID, "link").text.startswith("— no host link")
    memory = browser.find_element(By.ID, "memory").text
    assert re.search(r"VRAM allocated\s+—", memory) and re.search(r"process RSS\s+\d+(\.\d+)? MB", memory), memory
    assert console_errors(browser) == []


def test_with_an_api_key_the_page_asks_for_it_and_shows_the_apis_error(browser, tiny):
    browser.get(tiny.url + "/health")
    browser.execute_script("sessionStorage.clear()")
    browser.get(tiny.url + "/")
    assert wait(browser, lambda b: b.find_element(By.ID, "lock").is_displayed())
    assert not browser.find_element(By.ID, "views").is_displayed()
    assert "glm53-tiny" not in browser.page_source
    browser.find_element(By.ID, "key-input").send_keys("wrong\n")
    error = wait(browser, lambda b: b.find_element(By.ID, "key-error").text)
    assert error == "a valid API key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
    assert browser.execute_script("return sessionStorage.getItem('glm53.apiKey')") is None
    console_errors(browser)  # the 401 itself is logged by the browser
    field = browser.find_element(By.ID, "key-input")
    field.clear()
    field.send_keys(KEY + "\n")
    wait(browser, lambda b: b.find_element(By.ID, "views").is_displayed())
    assert browser.execute_script("return sessionStorage.getItem('glm53.apiKey')") == KEY
    assert browser.execute_script("return localStorage.length") == 0  # the key is never kept beyond this tab
    assert console_errors(browser) == []


def test_the_page_works_at_a_phone_width(browser, scripted):
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True})
    try:
        fresh(browser, scripted)
        overflow = "return [document.documentElement.scrollWidth, document.getElementById('messages').scrollWidth, innerWidth]"
        browser.find_element(By.ID, "toggle-settings").click()
        wait(browser, lambda b: b.find_element(By.ID, "set-max_tokens").is_displayed())
        set_field(browser, "max_tokens", "300")  # one 300-character word: it must wrap
        browser.find_element(By.ID, "set-thinking").click()
        browser.find_element(By.ID, "close-settings").click()
        ask(browser, "[[script:long]]")
        assert answered(browser) == "length" and answer_state(browser)[1] == "x" * 300
        page, messages, width = browser.execute_script(overflow)
        assert width == 390 and page <= width and messages <= width
        send = browser.find_element(By.ID, "send").rect
        assert send["x"] + send["width"] <= width
        browser.find_element(By.ID, "tab-engine").click()
        wait(browser, lambda b: b.find_element(By.ID, "heatmap").get_attribute("data-columns") not in (None, "0"))
        assert browser.execute_script(overflow)[0] <= width
        assert browser.find_element(By.CSS_SELECTOR, "#heatmap canvas").rect["width"] <= width
        assert console_errors(browser) == []
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
