"""A deployment on an open port, through the real server: a refused chunked body's 413
arrives whole, the key is checked before the body is read, heads have a deadline and
connections a cap, CORS (off unless asked for), HEAD wherever GET is, and no CDN-backed
/docs unless asked for."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from pagedllm.entrypoints import vllm_flags
from pagedllm.entrypoints.cli import parse_args
from tests.test_server import serve

KEY = "sk-hardening"
LIMIT = 1000  # --max-request-bytes
HEADER_TIMEOUT = 2.0
CAP = 4  # --max-connections
ORIGIN = "https://app.example"
SMALL_MODEL = ["--model", "smollm2-135m", "--load-format", "dummy",
               "--num-gpu-blocks-override", "32", "--swap-space", "0.01",
               "--max-model-len", "64", "--max-tokens-default", "5"]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    yield from serve([*SMALL_MODEL, "--api-key", KEY, "--max-request-bytes", str(LIMIT),
                      "--header-timeout", str(HEADER_TIMEOUT), "--timeout-keep-alive", "1",
                      "--max-connections", str(CAP), "--allowed-origins", ORIGIN,
                      "--allow-credentials", "--enable-fastapi-docs"])


@pytest.fixture(scope="module")
def plain_server():
    yield from serve(SMALL_MODEL)


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


TOO_LARGE = {"error": {"message": f"the request body is larger than this server's limit of "
                                  f"{LIMIT} bytes (`pagedllm serve --max-request-bytes`)",
                       "type": "invalid_request_error", "param": None,
                       "code": "request_too_large"}}


def test_chunked_body_over_the_limit_gets_its_whole_413(server):
    def chunks():
        for _ in range(50):
            yield b"x" * 4096  # 200 KiB, no Content-Length: chunked

    for _ in range(3):
        resp = httpx.post(server.url + "/v1/completions", content=chunks(),
                          headers={"Content-Type": "application/json"})
        assert resp.status_code == 413 and resp.json() == TOO_LARGE
        assert resp.headers["connection"] == "close"
    host, port = address(server.url)
    for _ in range(3):
        with socket.create_connection((host, port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(50):
                sock.sendall(b"1000\r\n" + b"y" * 4096 + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
            head, _, body = read_until_closed(sock, 10).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 ")
        assert json.loads(body) == TOO_LARGE
    # A declared length over the limit: the same answer, the body drained as well.
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 300000\r\n\r\n"
                     + b"z" * 300000)
        head, _, body = read_until_closed(sock, 10).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and json.loads(body) == TOO_LARGE


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe{}"], ids=["malformed", "not-utf8"])
def test_the_key_is_checked_before_the_body(server, body):
    json_type = {"Content-Type": "application/json"}
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        resp = httpx.post(server.url + path, content=body, headers=json_type)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["error"]["code"] == "invalid_api_key"
        resp = httpx.post(server.url + path, content=body, headers={**json_type, **AUTH})
        assert resp.status_code == 400, (path, resp.text)
    # Anthropic's route: its own error shape, the key first as well.
    resp = httpx.post(server.url + "/v1/messages", content=body, headers=json_type)
    assert resp.status_code == 401
    assert resp.json() == {"type": "error", "error": {"type": "authentication_error",
                                                      "message": "invalid x-api-key"}}
    resp = httpx.post(server.url + "/v1/messages", content=body,
                      headers={**json_type, "x-api-key": KEY})
    assert resp.status_code == 400 and resp.json()["type"] == "error"


def test_with_the_key_a_malformed_body_names_the_problem(server):
    resp = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                      headers={"Content-Type": "application/json", **AUTH})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("malformed JSON body: ")


def test_half_open_connections_are_capped_and_closed(server):
    host, port = address(server.url)
    opened = time.monotonic()
    half_open = []
    for k in range(CAP + 4):
        sock = socket.create_connection((host, port))
        if k % 2:
            sock.sendall(b"GET /health HTT")  # a request line, never finished
        half_open.append(sock)
    time.sleep(0.3)  # all accepted
    try:
        resp = httpx.get(server.url + "/health")
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "too_many_connections"
        assert resp.headers["retry-after"] == "1"
        for sock in half_open:
            answer = read_until_closed(sock, HEADER_TIMEOUT + 5)
            assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
        closed = time.monotonic() - opened
        assert HEADER_TIMEOUT - 0.5 < closed < HEADER_TIMEOUT + 3
    finally:
        for sock in half_open:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_head_deadline_does_not_cut_a_slow_body_or_a_request(server):
    """Once the head is in, the deadline is done: a body that takes longer is still read,
    and an idle keep-alive connection is closed after --timeout-keep-alive."""
    host, port = address(server.url)
    with socket.create_connection((host, port)) as sock:
        body = b'{"tokens": [1, 2]}'
        sock.sendall(b"POST /detokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
        time.sleep(HEADER_TIMEOUT + 1)
        sock.sendall(body[5:])
        sock.settimeout(10)
        answer = sock.recv(65536)
        while b"no tokenizer" not in answer and len(answer) < 1000:
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400 "), answer  # past the key: no tokenizer
        assert b"this model has no tokenizer" in answer
        start = time.monotonic()
        assert read_until_closed(sock, 10) == b""  # idle after its response: closed
        assert time.monotonic() - start < 3


def test_cors_preflight_and_simple_requests(server):
    preflight = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    resp = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(server.url + "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_cors_is_off_by_default(plain_server):
    resp = httpx.get(plain_server.url + "/health", headers={"Origin": ORIGIN})
    assert resp.status_code == 200
    assert not any(name.startswith("access-control-") for name in resp.headers)
    preflight = httpx.options(plain_server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405
    assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/ping", "/version", "/metrics", "/"])
def test_head_wherever_get_is(server, path):
    get = httpx.get(server.url + path, headers=AUTH)
    head = httpx.head(server.url + path, headers=AUTH)
    assert get.status_code == head.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(server.url + "/v1/models").status_code == 401  # still behind the key


def test_docs_are_off_by_default(plain_server, server):
    for path in ("/docs", "/redoc"):
        assert httpx.get(plain_server.url + path).status_code == 404
        page = httpx.get(server.url + path)  # --enable-fastapi-docs
        assert page.status_code == 200 and "/openapi.json" in page.text
    assert httpx.get(plain_server.url + "/openapi.json").json()["info"]["title"] == "pagedllm"


def test_disable_fastapi_docs_drops_the_schema_too():
    """In process: vLLM's --disable-fastapi-docs also removes /openapi.json."""
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import ServerConfig, build_app
    from tests.test_server_async_engine import ScriptedEngine

    config = ServerConfig(**vllm_flags.http_config(parse_args(["serve",
                                                               "--disable-fastapi-docs"])))
    assert (config.docs, config.openapi, config.allowed_origins) == (False, False, None)

    async def main():
        aengine = AsyncLLMEngine(ScriptedEngine())
        transport = httpx.ASGITransport(app=build_app(aengine, config))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            for path in ("/docs", "/redoc", "/openapi.json"):
                assert (await c.get(path)).status_code == 404
            assert (await c.get("/health")).status_code == 200
        await aengine.shutdown()

    asyncio.run(main())


def test_http_flags_parse_and_refuse_bad_values():
    http = vllm_flags.http_config(parse_args([
        "serve", "--allowed-origins", '["https://a.example", "https://b.example"]',
        "--allowed-methods", "GET,POST", "--header-timeout", "3.5"]))
    assert http["allowed_origins"] == ["https://a.example", "https://b.example"]
    assert http["allowed_methods"] == ["GET", "POST"] and http["allowed_headers"] == ["*"]
    assert (http["header_timeout"], http["timeout_keep_alive"]) == (3.5, 5.0)
    assert (http["max_connections"], http["docs"], http["openapi"]) == (1000, False, True)
    for argv, message in [
        (["--header-timeout", "0"], "--header-timeout must be a positive number of seconds"),
        (["--max-connections", "0"], "--max-connections must be at least 1, got 0"),
        (["--allowed-origins", "[1]"], "--allowed-origins: a JSON list of strings"),
        (["--enable-fastapi-docs", "--disable-fastapi-docs"], "contradict"),
    ]:
        with pytest.raises(vllm_flags.UsageError, match=message.replace("[", r"\[")):
            vllm_flags.http_config(parse_args(["serve", *argv]))
