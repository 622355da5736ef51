"""Headless Chromium for the web page tests: Debian's /usr/bin/chromium driven by Playwright
(Playwright's own browser download is not used: `make bootstrap` installs the system one).

One browser per test module (`browser_fixture`); each test opens a fresh context (empty
localStorage) through `open_page`, which collects console errors and uncaught exceptions and
fails the test if any appear.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
SCREENSHOTS = Path(__file__).resolve().parents[1] / "docs" / "screenshots"


def browser_fixture() -> Iterator:
    """A module fixture's body: one Chromium for the module."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: `make bootstrap` installs chromium"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


class ConsoleLog:
    """Console messages of type error and uncaught page exceptions, as text."""

    def __init__(self, page, allowed: Callable[[str], bool] = lambda text: False) -> None:
        self.errors: list[str] = []
        self.allowed = allowed
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def _console(self, message) -> None:
        if message.type == "error" and not self.allowed(message.text):
            self.errors.append(f"console: {message.text}")


@contextlib.contextmanager
def open_page(browser, viewport: dict | None = None,
              allowed: Callable[[str], bool] = lambda text: False):
    """A page in a fresh context; on exit, asserts the console saw no errors."""
    context = browser.new_context(viewport=viewport or DESKTOP)
    page = context.new_page()
    page.set_default_timeout(30_000)
    log = ConsoleLog(page, allowed)
    try:
        yield page
    finally:
        context.close()
    assert log.errors == [], log.errors  # reached only when the test itself passed


def wait_until(condition: Callable[[], object], timeout: float = 60, every: float = 0.05,
               what: str = "the condition") -> object:
    """Poll until `condition()` is truthy; its value is returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
