"""`pagedllm serve --api-key`: every /v1 route needs the key; /health and /metrics stay open.

A dummy-weight model without a tokenizer keeps this server quick to start (and covers the
routes' behaviour when there is no tokenizer)."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.test_server import serve

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server():
    yield from serve(["--api-key", KEY, "--model", "smollm2-135m", "--load-format", "dummy",
                      "--num-gpu-blocks-override", "32", "--swap-space", "0.01"])


V1_REQUESTS = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize("method,path,body", V1_REQUESTS, ids=[r[1] for r in V1_REQUESTS])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}], ids=["none", "wrong", "no-bearer"])
def test_v1_routes_need_the_key(server, method, path, body, headers):
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
    # This model has no tokenizer, so no chat template: a clear 400, not a 500.
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=card.id, messages=[{"role": "user",
                                                                 "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_health_and_metrics_stay_open(server):
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and "pagedllm:num_requests_running" in metrics.text
