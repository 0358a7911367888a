"""A headless Chromium driven by Selenium, for the built-in page's tests: Debian's ``chromium`` and
``chromium-driver`` (``.ci/run`` installs them), never a browser or driver that Selenium would download."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.wait import WebDriverWait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# No sandbox (CI runs as root), no GPU, and nothing that reaches the network on its own (the machine has none
# beyond the package registries): no background updates, sync, component downloads or first-run pages.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run")


@contextmanager
def chromium(width: int = 1280, height: int = 900) -> Iterator[webdriver.Chrome]:
    """A new browser with a fresh profile, its console kept for :func:`console_errors`."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    assert not missing, f"{', '.join(missing)} missing: apt-get install -y chromium chromium-driver (.ci/run does)"
    profile = tempfile.mkdtemp(prefix="glm53-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def console_errors(driver: webdriver.Chrome) -> list[str]:
    """The console's errors since the last call (failed loads, uncaught exceptions, CSP violations)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def wait(driver: webdriver.Chrome, condition: Callable[[webdriver.Chrome], object], timeout: float = 15.0):
    """``condition``'s first truthy value, polled every 20 ms."""
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(condition)
