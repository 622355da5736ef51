"""The web pages of a server started with --api-key: they load without the key, ask for it,
show the server's 401 message for a wrong one and work with the right one (kept in
sessionStorage). A dummy-weight model keeps the server quick to start."""
from __future__ import annotations

import httpx
import pytest

from tests.test_server import serve
from tests.web_helpers import browser_fixture, open_page

pytestmark = pytest.mark.slow

KEY = "sk-web-test-42"
WRONG_KEY_MESSAGE = "Incorrect API key provided."


def failed_401(text: str) -> bool:
    """Chromium logs every 4xx response as a console error: the 401s here are the test."""
    return text == "Failed to load resource: the server responded with a status of 401 " \
                   "(Unauthorized)"


@pytest.fixture(scope="module")
def server():
    yield from serve(["--api-key", KEY, "--model", "smollm2-135m", "--load-format", "dummy",
                      "--num-gpu-blocks-override", "32", "--swap-space", "0.01",
                      "--max-model-len", "64"])


@pytest.fixture(scope="module")
def browser():
    yield from browser_fixture()


def test_engine_state_needs_the_key(server):
    response = httpx.get(server.url + "/v1/engine/state")
    assert response.status_code == 401
    assert response.json()["error"]["message"] == WRONG_KEY_MESSAGE
    ok = httpx.get(server.url + "/v1/engine/state", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["num_gpu_blocks"] == 32
    assert httpx.get(server.url + "/").status_code == 200  # the page itself is open


def enter_key(page, key: str) -> None:
    page.fill("#key-input", key)
    page.click("#key-form button")


def test_chat_page_asks_for_the_key(browser, server):
    with open_page(browser, allowed=failed_401) as page:
        page.goto(server.url + "/")
        page.wait_for_selector("#key-panel:not([hidden])")
        assert "needs an API key" in page.inner_text("#key-error")
        enter_key(page, "sk-wrong")
        page.wait_for_selector(f"#key-error:text('{WRONG_KEY_MESSAGE}')")
        assert page.locator("#model option").count() == 0
        enter_key(page, KEY)
        page.wait_for_selector("#model option", state="attached")
        assert page.locator("#key-panel").is_hidden()
        assert page.evaluate("sessionStorage.getItem('pagedllm.apiKey')") == KEY
        page.reload()  # the key stays for the session
        page.wait_for_selector("#model option", state="attached")
        assert page.locator("#key-panel").is_hidden()


def test_engine_page_asks_for_the_key(browser, server):
    with open_page(browser, allowed=failed_401) as page:
        page.goto(server.url + "/ui/engine")
        page.wait_for_selector("#key-panel:not([hidden])")
        assert page.inner_text("#status") == WRONG_KEY_MESSAGE
        enter_key(page, "sk-wrong")
        page.wait_for_selector(f"#key-error:text('{WRONG_KEY_MESSAGE}')")
        enter_key(page, KEY)
        page.wait_for_selector("#status:text('live')")
        assert page.locator("#grid .block").count() == 32
        assert page.locator("#key-panel").is_hidden()
