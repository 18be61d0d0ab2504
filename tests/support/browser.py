"""A real browser for the dashboard tests: Debian's Chromium under its ChromeDriver (the
``browser`` fixture), and waits on the page."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
T = TypeVar("T")
# The dashboard tests' mark: they skip, saying why, where the browser is not installed.
NEEDS_BROWSER = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (make setup installs them)",
)


def wait(check: Callable[[], T | None], what: str, timeout_s: float = 30) -> T:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            found = check()
        except Exception as err:  # the page is changing under us: try again
            last = err
            found = None
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last error: {last})")


def text_of(driver: Any, css: str) -> str:
    """The text of the first element ``css`` finds ("" if none), read in the page in one step:
    the list redraws its rows as events come, so an element found and then read could be
    gone in between."""
    script = "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';"
    return str(driver.execute_script(script, css))


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--window-size=1440,1000",  # a laptop screen
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def points(driver: Any, chart: str) -> int:
    """The points a chart of a job's page drew (its ``data-points``; 0 before it drew)."""
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, f"#{chart}")
    value = found[0].get_attribute("data-points") if found else None
    return int(value or 0)
