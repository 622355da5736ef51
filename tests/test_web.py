"""The web pages in a real browser (headless Chromium through Playwright) against a real
`pagedllm serve` of the default model: the chat page at / and the engine view at /ui/engine,
and the GET /v1/engine/state they poll. Every test fails on a browser console error."""
from __future__ import annotations

import contextlib
import json
import re
import threading

import httpx
import pytest

from pagedllm.entrypoints.web.router import CSP
from pagedllm.entrypoints.web.schema import EngineState
from tests.test_server import REPO, scrape, serve
from tests.web_helpers import DESKTOP, PHONE, SCREENSHOTS, browser_fixture, open_page, wait_until

pytestmark = pytest.mark.slow

STATIC = REPO / "pagedllm" / "entrypoints" / "web" / "static"
NUM_BLOCKS = 128
# What the XSS test makes the model say (guided_regex forces it token by token).
HOSTILE = ('<img src=x onerror=window.pwned=1> <script>window.pwned=2</script> **bold**\n\n'
           '```py\nx = 1\n```')


@pytest.fixture(scope="module")
def server():
    yield from serve(["--max-model-len", "2048", "--num-gpu-blocks-override", str(NUM_BLOCKS),
                      "--swap-space", "0.05"])


@pytest.fixture(scope="module")
def browser():
    yield from browser_fixture()


def engine_state(server) -> dict:
    response = httpx.get(server.url + "/v1/engine/state", timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def num_running(server) -> int:
    return int(scrape(server.url)["vllm:num_requests_running"])


@contextlib.contextmanager
def open_chat(browser, server, viewport=None):
    with open_page(browser, viewport) as page:
        page.goto(server.url + "/")
        page.wait_for_selector("#model option", state="attached")
        yield page


def literal_regex(text: str) -> str:
    """A regex matching exactly `text` (llguidance's syntax: escape only metacharacters)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def set_extra(page, fields: dict, max_tokens: int | None = None) -> None:
    """Fill the settings panel: extra request fields (JSON) and max_tokens."""
    page.click("#toggle-settings")
    page.fill("#extra", json.dumps(fields))
    if max_tokens is not None:
        page.fill("#max_tokens", str(max_tokens))
    page.click("#toggle-settings")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page):
    return page.locator(".message.assistant").last


def complete(server, prompt, max_tokens: int, **extra) -> threading.Thread:
    """A completion request in a thread (the page under test watches the engine run it)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    thread = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", json=body,
                                                        timeout=120).raise_for_status())
    thread.start()
    return thread


# ---------------------------------------------------------------------- the pages themselves


def test_pages_carry_a_csp_and_ship_no_inline_script(server):
    for path in ("/", "/ui", "/ui/engine"):
        response = httpx.get(server.url + path)
        assert response.status_code == 200
        assert response.headers["content-security-policy"] == CSP
        assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
        scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", response.text, re.S)
        assert scripts and all(body.strip() == "" for body in scripts)  # src= only
    for name in ("chat.js", "engine.js", "markdown.js", "api.js", "style.css", "favicon.svg"):
        assert httpx.get(f"{server.url}/ui/static/{name}").status_code == 200
    assert httpx.get(server.url + "/ui/static/nope.js").status_code == 404
    for path in STATIC.glob("*.js"):
        text = path.read_text()
        for unsafe in ("innerHTML", "outerHTML", "insertAdjacentHTML", "eval(", "document.write"):
            assert unsafe not in text, f"{path.name} uses {unsafe}"


# ---------------------------------------------------------------------- chat


def test_chat_streams_stops_and_keeps_the_conversation(browser, server):
    with open_chat(browser, server) as page:
        send(page, "Write two sentences about the sea.")
        answer = last_answer(page)
        lengths = []
        while answer.get_attribute("data-done") is None:
            lengths.append(len(answer.locator(".body").inner_text()))
            page.wait_for_timeout(20)
        assert answer.get_attribute("data-done") == "finished"
        final = answer.locator(".body").inner_text()
        # It arrived in pieces: the text was seen at several lengths short of the final one.
        partial = {n for n in lengths if 0 < n < len(final)}
        assert len(partial) >= 2, lengths
        assert int(answer.get_attribute("data-chunks")) >= 3
        stats = answer.locator(".stats").inner_text()
        assert re.fullmatch(r"\d+ tokens · \d+ prompt tokens · [\d.]+ tok/s", stats), stats

        # A long answer, stopped mid-way: the request ends on the server too.
        set_extra(page, {"ignore_eos": True}, max_tokens=1500)
        send(page, "Count from one to a thousand.")
        answer = last_answer(page)
        wait_until(lambda: int(answer.get_attribute("data-chunks") or 0) >= 5,
                   what="the long answer to start")
        assert num_running(server) == 1
        page.click("#stop")
        page.wait_for_selector(".message.assistant[data-done=stopped]")
        stopped_text = answer.locator(".body").inner_text()
        assert re.fullmatch(r"stopped after \d+ chunks", answer.locator(".stats").inner_text())
        wait_until(lambda: num_running(server) == 0, timeout=10, what="the running count to be 0")
        assert engine_state(server)["queues"]["running"] == []

        # Reloaded, the page shows the same conversation.
        page.reload()
        page.wait_for_selector(".message.assistant")
        texts = page.locator(".message").all_inner_texts()
        assert texts[0].startswith("Write two sentences about the sea.")
        assert texts[2].startswith("Count from one to a thousand.")
        assert stopped_text in texts[3] and final in texts[1]
        assert page.locator("#conversations li").count() == 1
        assert page.locator("#conversations li.active .title").inner_text() == \
            "Write two sentences about the sea."


def test_conversations_new_rename_delete(browser, server):
    with open_chat(browser, server) as page:
        set_extra(page, {"max_tokens": 4})
        send(page, "Hello there")
        page.wait_for_selector(".message.assistant[data-done]")
        page.click("#new-chat")
        assert page.locator(".message").count() == 0
        send(page, "Second one")
        page.wait_for_selector(".message.assistant[data-done]")
        titles = page.locator("#conversations .title")
        assert titles.all_inner_texts() == ["Second one", "Hello there"]
        page.locator("#conversations li").nth(1).get_by_role("button", name="Rename").click()
        page.fill("#conversations .rename", "Greetings")
        page.press("#conversations .rename", "Enter")
        page.reload()
        page.wait_for_selector("#conversations li")
        assert titles.all_inner_texts() == ["Second one", "Greetings"]
        page.locator("#conversations li").nth(0).get_by_role("button", name="Delete").click()
        assert titles.all_inner_texts() == ["Greetings"]
        assert page.locator(".message.user").inner_text() == "Hello there"  # now shown
        page.reload()
        page.wait_for_selector("#conversations li")
        assert titles.all_inner_texts() == ["Greetings"]


def test_markup_in_model_output_runs_nothing(browser, server):
    """The real model, held by guided_regex, answers with an <img onerror> and a <script>:
    the page shows them as text and runs neither; markdown around them still renders."""
    with open_chat(browser, server) as page:
        dialogs = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        set_extra(page, {"guided_regex": literal_regex(HOSTILE), "temperature": 0})
        send(page, "Say something.")
        page.wait_for_selector(".message.assistant[data-done=finished]")
        body = last_answer(page).locator(".body")
        text = body.inner_text()
        assert "<img src=x onerror=window.pwned=1>" in text
        assert "<script>window.pwned=2</script>" in text
        assert body.locator("img, script, iframe, object").count() == 0
        assert body.locator("strong").inner_text() == "bold"
        assert body.locator("pre code.language-py").inner_text() == "x = 1"
        page.reload()  # rendered again from localStorage
        page.wait_for_selector(".message.assistant strong")
        assert page.evaluate("typeof window.pwned") == "undefined"
        assert page.locator("#messages img, #messages script").count() == 0
        assert dialogs == []


# Markdown the renderer must keep inert: each case's raw markup must come out as text.
HOSTILE_MARKDOWN = [
    '<img src=x onerror="window.pwned=1">',
    "<script>window.pwned=1</script>",
    '<a href="javascript:window.pwned=1">click</a>',
    "[click](javascript:window.pwned=1)",
    "[click](JaVaScRiPt:window.pwned=1)",
    "[data](data:text/html,<script>window.pwned=1</script>)",
    "![image](https://example.com/x.png)",
    "<iframe src=/ui></iframe> and <svg onload=window.pwned=1>",
    "**<b onmouseover=window.pwned=1>bold</b>**",
    "```html\n<script>window.pwned=1</script>\n```",
    "> <style>body{display:none}</style>",
    "- item <img src=x onerror=window.pwned=1>\n- `<script>`",
]
ALLOWED_TAGS = {"P", "BR", "STRONG", "EM", "CODE", "PRE", "A", "H1", "H2", "H3", "H4", "H5",
                "H6", "UL", "OL", "LI", "BLOCKQUOTE", "HR"}
RENDER_IN_PAGE = """async (cases) => {
  const { renderMarkdown } = await import("/ui/static/markdown.js");
  return cases.map((text) => {
    const box = document.createElement("div");
    box.appendChild(renderMarkdown(text));
    document.body.appendChild(box);
    return {tags: [...box.querySelectorAll("*")].map((e) => e.tagName),
            hrefs: [...box.querySelectorAll("a")].map((a) => a.getAttribute("href")),
            text: box.textContent};
  });
}"""


def test_markdown_renderer_keeps_markup_inert(browser, server):
    """The page's own renderer, in the page, on markup a model could write."""
    with open_page(browser) as page:
        page.goto(server.url + "/")
        results = page.evaluate(RENDER_IN_PAGE, HOSTILE_MARKDOWN + [
            "# Title\n\nA [link](https://example.com/a?b=1) and *em*.\n\n1. one\n2. two"])
        page.wait_for_timeout(300)  # an onerror or onload would have run by now
        assert page.evaluate("typeof window.pwned") == "undefined"
    for case, result in zip(HOSTILE_MARKDOWN, results):
        assert set(result["tags"]) <= ALLOWED_TAGS, (case, result)
        assert all(h.startswith(("https://", "http://", "mailto:")) for h in result["hrefs"])
        for markup in re.findall(r"<[^>]+>", case):
            assert markup in result["text"], (case, result)
    last = results[-1]
    assert last["tags"] == ["H1", "P", "A", "EM", "OL", "LI", "LI"]
    assert last["hrefs"] == ["https://example.com/a?b=1"]


# ---------------------------------------------------------------------- engine view


def grid_count(page, code: str) -> int:
    return page.locator(f"#grid .b-{code}").count()


def hover_text(page, code: str, pattern: str) -> str | None:
    """Hover the first block of state `code`; the hover line if it matches `pattern` (the
    block may change state between finding and hovering it: callers retry)."""
    blocks = page.locator(f"#grid .b-{code}")
    if blocks.count() == 0:
        return None
    blocks.first.hover()
    text = page.inner_text("#hover")
    return text if re.search(pattern, text) else None


def test_engine_view_follows_a_batch(browser, server):
    with open_page(browser) as page:
        page.goto(server.url + "/ui/engine")
        page.wait_for_selector("#status:text('live')")
        assert page.locator("#grid .block").count() == NUM_BLOCKS
        assert grid_count(page, "u") == 0
        prompts = [f"Request number {i} asks for a long story about ships." for i in range(4)]
        thread = complete(server, prompts, 48, ignore_eos=True)
        wait_until(lambda: grid_count(page, "u") >= 4, what="used blocks in the grid")
        assert int(page.inner_text("#n-running")) >= 1
        assert page.locator("#queue-rows tr.q-running").count() >= 1
        wait_until(lambda: hover_text(page, "u", r"GPU block \d+: used · seq \d+ \(request \w+"),
                   what="a used block named by its sequence")
        thread.join()
        wait_until(lambda: grid_count(page, "u") == 0 and page.inner_text("#n-running") == "0",
                   what="the grid to empty")
        assert page.inner_text("#queue-rows").strip() == "idle"
        assert float(page.inner_text("#tps-now").split()[1]) >= 0


def test_engine_view_shows_blocks_shared_by_a_prefix(browser, server):
    prompt = "A shared prefix: " + " ".join(f"word{i}" for i in range(60))
    with open_page(browser) as page:
        page.goto(server.url + "/ui/engine")
        page.wait_for_selector("#status:text('live')")
        first = complete(server, prompt, 160, ignore_eos=True)
        wait_until(lambda: any(e["num_output_tokens"] > 0
                               for e in engine_state(server)["queues"]["running"]),
                   what="the first request to decode")
        second = complete(server, prompt, 40, ignore_eos=True)
        wait_until(lambda: grid_count(page, "s") >= 2, what="shared blocks in the grid")
        text = wait_until(lambda: hover_text(page, "s", r"GPU block \d+: shared · seq"),
                          what="a shared block named by its sequences")
        assert len(re.findall(r"seq \d+", text)) == 2
        wait_until(lambda: "prefix cache:" in page.inner_text("#events"),
                   what="the prefix-cache hit event")
        second.join()
        first.join()
        wait_until(lambda: grid_count(page, "s") == 0 and grid_count(page, "c") > 0,
                   what="shared blocks to become cached ones")


def test_engine_state_route_matches_its_documented_schema(server):
    thread = complete(server, ["Tell me about tea.", "And about coffee."], 24, ignore_eos=True)
    state = wait_until(lambda: (s := engine_state(server))["queues"]["running"] and s,
                       what="a running request")
    thread.join()
    EngineState.model_validate(state)
    assert len(state["gpu_blocks"]) == state["num_gpu_blocks"] == NUM_BLOCKS
    for entry in state["queues"]["running"]:
        assert entry["blocks"] and all(state["gpu_blocks"][b] in "us" for b in entry["blocks"])
    idle = engine_state(server)
    assert idle["queues"] == {"running": [], "waiting": [], "swapped": []}
    assert set(idle["gpu_blocks"]) <= {"f", "c"}
    assert idle["counters"]["generation_tokens"] >= state["counters"]["generation_tokens"] + 0
    schema = httpx.get(server.url + "/openapi.json").json()
    assert "EngineState" in json.dumps(schema["paths"]["/v1/engine/state"])


# ---------------------------------------------------------------------- screenshots


def test_screenshots_of_both_pages(browser, server):
    """docs/screenshots/{chat,engine}-{desktop,phone}.png, linked from the README."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        with open_chat(browser, server, viewport) as page:
            set_extra(page, {"temperature": 0}, max_tokens=90)
            send(page, "Write a Python function that adds two numbers.")
            page.wait_for_selector(".message.assistant[data-done]")
            page.screenshot(path=str(SCREENSHOTS / f"chat-{name}.png"))
        with open_page(browser, viewport) as page:
            page.goto(server.url + "/ui/engine")
            page.wait_for_selector("#status:text('live')")
            prompt = "A shared prefix for the picture: " + " ".join(f"w{i}" for i in range(50))
            threads = [complete(server, [prompt, f"Another request {name}"], 40, ignore_eos=True)]
            wait_until(lambda: grid_count(page, "u") > 0, what="a busy grid")
            threads.append(complete(server, prompt, 20, ignore_eos=True))
            wait_until(lambda: grid_count(page, "s") > 0, what="shared blocks")
            page.wait_for_timeout(1500)
            page.screenshot(path=str(SCREENSHOTS / f"engine-{name}.png"), full_page=True)
            for thread in threads:
                thread.join()
    for name in ("chat-desktop", "chat-phone", "engine-desktop", "engine-phone"):
        assert (SCREENSHOTS / f"{name}.png").stat().st_size > 10_000
