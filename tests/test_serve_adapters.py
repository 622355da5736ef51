"""LoRA adapters behind a server of several base models: a request naming an adapter goes to
the base holding it, /v1/models and /v1/models/{id} know every base and adapter, and an
unknown name is a 404 listing them all."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.test_lora import PROMPTS, adapters, llm, offline_text  # noqa: F401 (fixtures)
from tests.test_server import serve

pytestmark = pytest.mark.slow
KEY = "sk-adapters"


@pytest.fixture(scope="module")
def server(default_gguf, adapters):  # noqa: F811
    a = adapters["a"][0].lora_path
    yield from serve(["--model", default_gguf, "--model", default_gguf,
                      "--served-model-name", "alpha", "beta", "--dtype", "float32",
                      "--kv-cache-memory", str(64 << 20), "--max-model-len", "512",
                      "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                      "--api-key", KEY, "--lora-modules", f"adapter-a={a}"])


def test_an_adapter_routes_to_its_base(server, llm, adapters):  # noqa: F811
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                           timeout=300)
    cards = {m.id: m.parent for m in client.models.list().data}
    assert cards == {"alpha": None, "adapter-a": "alpha", "beta": None}
    assert client.models.retrieve("adapter-a").parent == "alpha"
    answer = client.completions.create(model="adapter-a", prompt=PROMPTS[1], max_tokens=16,
                                       temperature=0.0)
    assert answer.choices[0].text == offline_text(llm, PROMPTS[1], adapters["a"][0])
    resp = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "adapter-z", "prompt": "hi", "max_tokens": 2})
    assert (resp.status_code, resp.json()["error"]["message"]) == (
        404, "The model `adapter-z` does not exist; this server serves: alpha, adapter-a, beta")
    gone = httpx.get(server.url + "/v1/models/adapter-z", headers={"Authorization": f"Bearer {KEY}"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
