"""The README's two screenshots of the built-in page, taken in the headless Chromium of the tests against the scripted
model (its /stats carries the offload figures of a recorded H200 run: ``scripted_server.recorded_offload``).

    python -m tests.server.web_screenshots [--out tests/server/screenshots]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from selenium.webdriver.common.by import By

from .browser import chromium, wait
from .servers import REPO, Server
from .test_web import WEATHER_TOOL, answered, ask, fresh, set_field

STEP_S = 0.025  # about 40 tokens a second, a GPU's pace rather than the CPU's


def chat_view(browser, server: Server, out: Path) -> None:
    fresh(browser, server)
    set_field(browser, "tools", json.dumps([WEATHER_TOOL]))
    set_field(browser, "temperature", "0.7")
    ask(browser, "What will the weather be in New York? [[script:weather]]")
    answered(browser, 60)
    ask(browser, "And as Markdown? [[script:html]]")
    answered(browser, 60)
    first = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant details.reasoning")[0]
    first.find_element(By.TAG_NAME, "summary").click()
    browser.save_screenshot(str(out / "chat.png"))


def dashboard_view(browser, server: Server, out: Path, seconds: float) -> None:
    browser.set_window_size(1280, 1280)  # every panel in one picture
    fresh(browser, server, "engine")

    def load():
        # a stream, then two at once: the decode and jobs charts change with it
        for streams in (1, 2, 1):
            threads = [threading.Thread(target=server.post, args=("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "[[script:long]]"}], "max_tokens": int(seconds / 3 / STEP_S),
                "chat_template_kwargs": {"enable_thinking": False}})) for _ in range(streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    worker = threading.Thread(target=load)
    worker.start()
    time.sleep(seconds * 0.9)
    wait(browser, lambda b: b.find_element(By.ID, "heatmap").get_attribute("data-columns") not in (None, "0"))
    browser.save_screenshot(str(out / "dashboard.png"))
    worker.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "tests/server/screenshots")
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the dashboard watches a load first")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server = Server([], env={"SCRIPTED_STEP_S": str(STEP_S), "SCRIPTED_OFFLOAD": "1"}, module="tests.server.scripted_server").wait_ready()
    try:
        with chromium(1280, 900) as browser:
            chat_view(browser, server, args.out)
            dashboard_view(browser, server, args.out, args.seconds)
    finally:
        server.stop()
    for name in ("chat.png", "dashboard.png"):
        print(args.out / name, (args.out / name).stat().st_size, "bytes")


if __name__ == "__main__":
    main()
