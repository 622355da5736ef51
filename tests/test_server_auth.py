"""`pagedllm serve --api-key`: every route that touches the model needs the key (/v1/*,
/tokenize, /detokenize); /health and /metrics stay open (unless --metrics-need-key).

A dummy-weight model without a tokenizer keeps this server quick to start (and covers the
routes' behaviour when there is no tokenizer)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.test_server import serve

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server():
    yield from serve(["--api-key", KEY, "--model", "smollm2-135m", "--load-format", "dummy",
                      "--num-gpu-blocks-override", "32", "--swap-space", "0.01",
                      "--max-model-len", "64", "--max-tokens-default", "5"])


KEYED_REQUESTS = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]


@pytest.mark.parametrize("method,path,body", KEYED_REQUESTS, ids=[r[1] for r in KEYED_REQUESTS])
@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
    # Not ASCII: compared as bytes (this was a 500 from hmac.compare_digest).
    {"Authorization": "Bearer sékret".encode()}, {"Authorization": f"Bearer {KEY}é".encode()},
], ids=["none", "wrong", "no-bearer", "non-ascii", "key-plus-non-ascii"])
def test_model_routes_need_the_key(server, method, path, body, headers):
    resp = httpx.request(method, server.url + path, json=body, headers=headers)
    assert resp.status_code == 401
    assert resp.json() == {"error": {"message": "Incorrect API key provided.",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}


def test_key_grants_access(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    (card,) = client.models.list().data
    assert card.id == "smollm2-135m"
    resp = client.completions.create(model=card.id, prompt=[1, 2, 3], max_tokens=3,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 3
    # No max_tokens: `--max-tokens-default 5` (OpenAI's 16 without it).
    resp = client.completions.create(model=card.id, prompt=[1, 2, 3],
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 5 and resp.choices[0].finish_reason == "length"
    # The server's default is capped to the room the context leaves (a client's is not).
    resp = client.completions.create(model=card.id, prompt=list(range(1, 63)),
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="more than the model's context of 64"):
        client.completions.create(model=card.id, prompt=list(range(1, 63)), max_tokens=5)
    headers = {"Authorization": f"Bearer {KEY}"}
    tokens = httpx.post(server.url + "/detokenize", json={"tokens": [1]}, headers=headers)
    assert tokens.status_code == 400  # past the key: this model has no tokenizer
    assert tokens.json()["error"]["message"] == "this model has no tokenizer"
    # This model has no tokenizer, so no chat template: a clear 400, not a 500.
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=card.id, messages=[{"role": "user",
                                                                 "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_health_and_metrics_stay_open(server):
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text


def test_metrics_need_key_and_non_ascii_keys():
    """In process: `--metrics-need-key`, and a key that is not ASCII (sent as UTF-8)."""
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import ServerConfig, build_app
    from tests.test_server_async_engine import ScriptedEngine

    async def main():
        aengine = AsyncLLMEngine(ScriptedEngine())
        app = build_app(aengine, ServerConfig(api_key="sékret", metrics_need_key=True))
        transport = httpx.ASGITransport(app=app)
        good = {"Authorization": "Bearer sékret".encode()}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            assert (await c.get("/metrics")).status_code == 401
            assert (await c.get("/metrics", headers=good)).status_code == 200
            assert (await c.get("/health")).json() == {"status": "ok"}
            assert (await c.get("/v1/models", headers=good)).status_code == 200
            wrong = {"Authorization": "Bearer sekret".encode()}
            assert (await c.get("/v1/models", headers=wrong)).status_code == 401
            schema = (await c.get("/openapi.json")).json()["paths"]
            assert "401" in schema["/metrics"]["get"]["responses"]
            assert "401" in schema["/tokenize"]["post"]["responses"]
            assert "401" not in schema["/health"]["get"]["responses"]
        await aengine.shutdown()

    asyncio.run(main())

