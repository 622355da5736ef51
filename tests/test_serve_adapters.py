"""LoRA adapters behind a server of several base models: a request naming an adapter goes to
the base holding it, /v1/models and /v1/models/{id} know every base and adapter, and an
unknown name is a 404 listing them all; a load names its base in `base_model`, an unload
finds the adapter by name, and adapter names stay unique across the server (at start too)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedllm.entrypoints.cli import main
from tests.test_lora import PROMPTS, adapters, llm, offline_text  # noqa: F401 (fixtures)
from tests.test_server import serve

pytestmark = pytest.mark.slow
KEY = "sk-adapters"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(default_gguf, adapters, tmp_path_factory):  # noqa: F811
    # alpha and beta: the default model with LoRA on (the command line's flags); gamma: a
    # dummy preset without it.
    config = tmp_path_factory.mktemp("models") / "models.json"
    config.write_text(json.dumps([
        {"model": default_gguf, "served_model_name": "alpha"},
        {"model": default_gguf, "served_model_name": "beta"},
        {"model": "smollm2-135m", "load_format": "dummy", "served_model_name": "gamma",
         "enable_lora": False}]))
    a = adapters["a"][0].lora_path
    yield from serve(["--models-config", str(config), "--dtype", "float32",
                      "--kv-cache-memory", str(64 << 20), "--max-model-len", "512",
                      "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                      "--api-key", KEY, "--lora-modules", f"adapter-a={a}"])


def test_an_adapter_routes_to_its_base(server, llm, adapters):  # noqa: F811
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                           timeout=300)
    cards = {m.id: m.parent for m in client.models.list().data}
    assert cards == {"alpha": None, "adapter-a": "alpha", "beta": None, "gamma": None}
    assert client.models.retrieve("adapter-a").parent == "alpha"
    answer = client.completions.create(model="adapter-a", prompt=PROMPTS[1], max_tokens=16,
                                       temperature=0.0)
    assert answer.choices[0].text == offline_text(llm, PROMPTS[1], adapters["a"][0])
    resp = httpx.post(server.url + "/v1/completions", headers=AUTH,
                      json={"model": "adapter-z", "prompt": "hi", "max_tokens": 2})
    assert (resp.status_code, resp.json()["error"]["message"]) == (
        404, "The model `adapter-z` does not exist; this server serves: alpha, adapter-a, "
        "beta, gamma")
    gone = httpx.get(server.url + "/v1/models/adapter-z", headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=300)


def error_of(resp: httpx.Response) -> tuple[int, dict]:
    return resp.status_code, resp.json()["error"]


@pytest.mark.parametrize("body, status, message, param", [
    ({}, 400, "This server serves several base models (alpha, beta, gamma): name the one to "
     "load the adapter onto in `base_model`.", "base_model"),
    ({"base_model": "delta"}, 404,
     "The base model `delta` does not exist; this server serves: alpha, beta, gamma",
     "base_model"),
    ({"base_model": "gamma"}, 400, "LoRA is not enabled on the base model 'gamma': serve it "
     "with --enable-lora (enable_lora in --models-config)", "base_model"),
    ({"base_model": "beta", "lora_name": "adapter-a"}, 400,
     "The lora adapter 'adapter-a' has already been loaded.", "lora_name"),
    ({"lora_name": "adapter-a"}, 400,
     "The lora adapter 'adapter-a' has already been loaded.", "lora_name"),
    ({"base_model": "beta", "lora_name": "alpha"}, 400,
     "The lora adapter 'alpha' cannot be loaded: 'alpha' is the name of a served base "
     "model.", "lora_name"),
])
def test_a_load_is_refused_in_openai_shape(server, adapters, body, status, message, param):
    body = {"lora_name": "adapter-b", "lora_path": adapters["b"][0].lora_path, **body}
    assert post(server, "/v1/load_lora_adapter", body, headers={}).status_code == 401
    code = "model_not_found" if status == 404 else None
    assert error_of(post(server, "/v1/load_lora_adapter", body)) == (status, {
        "message": message, "type": "invalid_request_error", "param": param, "code": code})


def test_load_onto_a_named_base_and_unload_by_name(server, llm, adapters):  # noqa: F811
    b = {"lora_name": "adapter-b", "lora_path": adapters["b"][0].lora_path}
    loaded = post(server, "/v1/load_lora_adapter", {**b, "base_model": "beta"})
    assert loaded.text == "Success: LoRA adapter 'adapter-b' added successfully."
    cards = {c["id"]: c["parent"]
             for c in httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]}
    assert cards["adapter-b"] == "beta" and cards["adapter-a"] == "alpha"

    def complete(model: str) -> httpx.Response:
        return post(server, "/v1/completions", {"model": model, "prompt": PROMPTS[1],
                                                "max_tokens": 16, "temperature": 0.0})

    answer = complete("adapter-b")
    assert answer.json()["choices"][0]["text"] == offline_text(llm, PROMPTS[1],
                                                               adapters["b"][0])
    # base_model is respected: adapter-a is alpha's, not beta's.
    assert error_of(post(server, "/v1/unload_lora_adapter",
                         {"lora_name": "adapter-a", "base_model": "beta"})) == (404, {
        "message": "The lora adapter 'adapter-a' cannot be found.",
        "type": "invalid_request_error", "param": "lora_name", "code": "model_not_found"})
    unloaded = post(server, "/v1/unload_lora_adapter", {"lora_name": "adapter-b"})
    assert unloaded.text == "Success: LoRA adapter 'adapter-b' removed successfully."
    assert complete("adapter-b").status_code == 404
    status, error = error_of(post(server, "/v1/unload_lora_adapter",
                                  {"lora_name": "adapter-b"}))
    assert (status, error["message"]) == (404, "The lora adapter 'adapter-b' cannot be found.")
    assert error_of(post(server, "/v1/unload_lora_adapter",
                         {"lora_name": "adapter-a", "base_model": "gamma"}))[0] == 400


def test_metrics_have_the_lora_gauge_of_the_bases_with_lora(server):
    from tests.test_lora import lora_info

    samples = {s.labels["model_name"]: s.labels for s in lora_info(server.url)}
    assert samples == {name: {"model_name": name, "max_lora": "2", "running_lora_adapters": "",
                              "waiting_lora_adapters": ""} for name in ("alpha", "beta")}


@pytest.mark.parametrize("config, argv, message", [
    ([{"served_model_name": "a", "lora_modules": ["x=/p"]},
      {"served_model_name": "b", "lora_modules": ["x=/q"]}], [],
     "the LoRA adapter name 'x' is given by a and by b: adapter names are unique across "
     "the server"),
    ([{"served_model_name": "a", "lora_modules": ["b=/p"]}, {"served_model_name": "b"}], [],
     "the LoRA adapter 'b' of a is named like a served base model: give it another name"),
    (None, ["--served-model-name", "a", "--lora-modules", "a=/p"],
     "the LoRA adapter 'a' of a is named like a served base model: give it another name"),
    (None, ["--served-model-name", "a", "--lora-modules", "x=/p", "x=/q"],
     "the LoRA adapter name 'x' is given twice by a: adapter names are unique across the "
     "server"),
])
def test_clashing_adapter_names_are_refused_at_start(tmp_path, capsys, config, argv, message):
    if config is not None:
        path = tmp_path / "models.json"
        path.write_text(json.dumps(config))
        argv = [*argv, "--models-config", str(path)]
    assert main(["serve", "--port", "0", "--enable-lora", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_adapter_named_like_the_default_name_is_refused_once_loaded(default_gguf, capsys):
    # The model's default name comes from its weights: checked after it loads.
    argv = ["serve", "--port", "0", "--model", default_gguf, "--enable-lora", "--max-model-len",
            "512", "--num-gpu-blocks-override", "8", "--lora-modules",
            "SmolLM2-135M-Instruct=/p"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert ("the LoRA adapter 'SmolLM2-135M-Instruct' of " in err
            and "is named like a served base model: give it another name" in err)
    assert "Traceback" not in err
