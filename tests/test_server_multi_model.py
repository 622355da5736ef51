"""Several base models in one server (`pagedllm serve --model a --model b`): the default model
twice under two names, each its own engine with a small KV cache, through the real server."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.cli import main, parse_args
from pagedllm.entrypoints.serve_models import model_namespaces
from pagedllm.entrypoints.usage import UsageError
from tests.test_server import serve

pytestmark = pytest.mark.slow
KEY = "sk-multi"
SMALL = ["--num-gpu-blocks-override", "32", "--swap-space", "0.01", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def server(default_gguf):
    yield from serve(["--model", default_gguf, "--model", default_gguf,
                      "--served-model-name", "alpha", "beta", "--api-key", KEY, *SMALL])


def test_both_models_answer_concurrently_and_route_by_name(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                           timeout=300)
    assert [m.id for m in client.models.list().data] == ["alpha", "beta"]

    def ask(model: str) -> tuple[str, str]:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=6, temperature=0, stream=True)
        chunks = list(stream)
        return chunks[0].model, "".join(c.choices[0].delta.content or "" for c in chunks
                                        if c.choices)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, ["alpha", "beta", "alpha", "beta"]))
    assert [model for model, _ in answers] == ["alpha", "beta", "alpha", "beta"]
    assert len({text for _, text in answers}) == 1 and answers[0][1]  # the same weights
    # Each engine counted its own requests: two each, under its own model_name.
    text = httpx.get(server.url + "/metrics").text
    success = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                name = sample.labels["model_name"]
                success[name] = success.get(name, 0) + sample.value
    assert success == {"alpha": 2, "beta": 2}
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1  # one family, two series
    assert 'vllm:num_requests_running{model_name="alpha"}' in text
    assert 'vllm:num_requests_running{model_name="beta"}' in text


def test_an_unknown_model_is_a_404_naming_the_served_ones(server):
    message = "The model `gamma` does not exist; this server serves: alpha, beta"
    body = {"model": "gamma", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 404
    assert resp.json()["error"] == {"message": message, "type": "invalid_request_error",
                                    "param": "model", "code": "model_not_found"}
    resp = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert resp.status_code == 404
    assert resp.json() == {"type": "error", "error": {"type": "not_found_error",
                                                      "message": message}}
    # The key comes first: without it, a 401 whatever the model.
    resp = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    # A malformed body is the first model's app's 400, as with one model.
    resp = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                      headers={"Authorization": f"Bearer {KEY}",
                               "Content-Type": "application/json"})
    assert resp.status_code == 400 and "malformed JSON body" in resp.json()["error"]["message"]


def test_models_config_file_gives_per_model_options(tmp_path, default_gguf):
    config = tmp_path / "models.yaml"
    config.write_text(f"- model: {default_gguf}\n  served_model_name: a\n"
                      f"  kv_cache_memory: 20000000\n"
                      f"- served_model_name: b\n  gpu_memory_utilization: 0.3\n")
    spaces = model_namespaces(parse_args(["serve", "--models-config", str(config)]))
    assert [(ns.model, ns.served_model_name, ns.kv_cache_memory) for ns in spaces] == [
        (default_gguf, "a", 20000000), (None, "b", None)]
    # Shares of the device, cumulative: a gets the 0.6 b leaves of the default 0.9.
    assert [ns.gpu_memory_utilization for ns in spaces] == pytest.approx([0.6, 0.9])


@pytest.mark.parametrize("config, argv, message", [
    ('[{"gpu_memory_utilization": 0.7}, {"gpu_memory_utilization": 0.6}]', [],
     "the models' gpu_memory_utilization add up to 1.3 (the default model: 0.7, the "
     "default model: 0.6), more than the whole device (1)"),
    ('[{"served_model_name": "a", "gpu_memory_utilization": 0.9}, {"served_model_name": "b"}]',
     [], "the models' gpu_memory_utilization (a: 0.9) leave none of "
     "--gpu-memory-utilization 0.9 to b"),
    ('[{"kv_cache_memory": 1e15}, {}]', [], "the models' kv_cache_memory add up to"),
    ('[{"kv_cache_size": 5}]', [], "model 0: unknown option 'kv_cache_size'"),
    ('{"a": 1}', [], "a non-empty list of per-model option objects"),
    ("[{", [], "not valid JSON"),
    (None, ["--model", "x", "--model", "y", "--served-model-name", "a"],
     "with 2 --model, --served-model-name takes 2 names (one per model, in order), got 1"),
])
def test_bad_model_splits_are_refused_before_loading(tmp_path, capsys, config, argv, message):
    if config is not None:
        path = tmp_path / "models.json"
        path.write_text(config)
        argv = [*argv, "--models-config", str(path)]
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        model_namespaces(parse_args(["serve", *argv]))
    assert main(["serve", "--port", "0", *argv]) == 2
    assert message in capsys.readouterr().err


def test_two_models_under_one_name_are_refused(default_gguf, capsys):
    assert main(["serve", "--port", "0", "--model", default_gguf, "--model", default_gguf,
                 *SMALL]) == 2
    assert "two models are served as" in capsys.readouterr().err


def test_each_model_card_comes_from_its_engine(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    for name in ("alpha", "beta"):
        card = httpx.get(server.url + f"/v1/models/{name}", headers=auth)
        assert card.status_code == 200 and card.json()["id"] == name
    assert httpx.get(server.url + "/v1/models/gamma", headers=auth).status_code == 404
