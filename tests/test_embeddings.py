"""Embeddings: LLM.embed and POST /v1/embeddings against transformers' fp32 forward of the
same GGUF, batching, KV blocks, the official clients (openai, LangChain) and bad input."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from pagedllm import PoolingParams
from pagedllm.engine_args import EngineArgs
from tests.prompts import mixed_prompts
from tests.test_server import serve

pytestmark = pytest.mark.slow

KEY = "embed-test-key"
MAX_MODEL_LEN = 512
# A step budget under the longest prompt below: its mean is pooled over several chunks.
BUDGET = 32
SERVER_ARGS = ["--dtype", "float32", "--pooling", "mean", "--api-key", KEY,
               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(BUDGET),
               "--num-gpu-blocks-override", "64", "--swap-space", "0.05"]
TEXTS = ["Hello", "The capital of France is Paris.", mixed_prompts()[12],
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"]


def reference(hf_reference, token_ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' final hidden states (after the final norm), pooled and normalized."""
    model, _ = hf_reference
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return F.normalize(vector.double(), dim=-1)


def cosine(a, b) -> float:
    return F.cosine_similarity(torch.as_tensor(a, dtype=torch.float64),
                               torch.as_tensor(b, dtype=torch.float64), dim=0).item()


def assert_no_blocks_held(engine) -> None:
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert not bm.block_tables and not engine.scheduler.has_unfinished_seqs()
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks


# ---------------------------------------------------------------------- offline


def test_embed_matches_transformers(default_llm, hf_reference):
    tokenizer = default_llm.get_tokenizer()
    outs = default_llm.embed(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        ids = tokenizer.encode(text)
        assert out.prompt_token_ids == ids and out.prompt == text
        assert len(out.outputs.embedding) == 576
        assert abs(sum(x * x for x in out.outputs.embedding) - 1) < 1e-5  # L2-normalized
        assert cosine(out.outputs.embedding, reference(hf_reference, ids, "last")) >= 0.9999
    assert_no_blocks_held(default_llm.engine)


def test_embed_batch_of_32_matches_one_at_a_time(default_llm):
    prompts = mixed_prompts()  # half share a 60-token prefix: prefix-cache hits too
    alone = [default_llm.embed(p, use_tqdm=False)[0].outputs.embedding for p in prompts]
    batched = [o.outputs.embedding for o in default_llm.embed(prompts, use_tqdm=False)]
    for a, b in zip(alone, batched):
        # The same vectors up to fp32 rounding of other batch shapes (never bit-exact).
        assert (torch.tensor(a) - torch.tensor(b)).abs().max() < 1e-4
        assert cosine(a, b) > 0.99999
    assert_no_blocks_held(default_llm.engine)


def test_embed_token_ids_unnormalized_and_mixed_with_generation(default_llm, hf_reference):
    from pagedllm import SamplingParams

    ids = default_llm.get_tokenizer().encode(TEXTS[1])
    engine = default_llm.engine
    # A generation request in the same steps as the pooling one.
    engine.add_request("gen-beside-embed", TEXTS[0], SamplingParams(max_tokens=4,
                                                                      temperature=0))
    raw = default_llm.embed({"prompt_token_ids": ids}, PoolingParams(normalize=False),
                            use_tqdm=False)[0].outputs.embedding
    while engine.has_unfinished_requests():
        engine.step()
    assert abs(torch.tensor(raw).norm().item() - 1) > 1e-3
    assert cosine(raw, reference(hf_reference, ids, "last")) >= 0.9999
    assert_no_blocks_held(engine)


def test_embed_refuses_bad_input(default_llm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        default_llm.embed([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="does not support dimensions=64: its embeddings "
                                         "have 576 dimensions"):
        default_llm.embed("hi", PoolingParams(dimensions=64), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    too_long = [1] * (default_llm.engine.max_model_len + 1)
    with pytest.raises(ValueError, match=r"the prompt has \d+ tokens, but the model's context"):
        default_llm.embed([too_long], use_tqdm=False)
    with pytest.raises(TypeError, match="pooling_params must be PoolingParams"):
        default_llm.embed("hi", "mean", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling must be one of last, mean, got 'max'"):
        EngineArgs(pooling="max")
    assert_no_blocks_held(default_llm.engine)


# ----------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server():
    yield from serve(SERVER_ARGS)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def post(server, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/embeddings", json=body, headers=headers, timeout=300)


def test_openai_client_mean_pooling_matches_transformers(client, default_llm, hf_reference):
    tokenizer = default_llm.get_tokenizer()
    token_ids = [tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, token_ids)) > 2 * BUDGET  # pooled over three chunks or more
    model = client.models.list().data[0].id
    resp = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire
    # The same prompts again: a mean needs every token, so no prefix-cache hit may skip any.
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    assert resp.model == model and resp.usage.prompt_tokens == sum(map(len, token_ids))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens
    for ids, b64, flt in zip(token_ids, resp.data, floats.data):
        assert cosine(b64.embedding, reference(hf_reference, ids, "mean")) >= 0.9999
        assert cosine(flt.embedding, reference(hf_reference, ids, "mean")) >= 0.9999
        # the same vector both ways (base64 is the float32 bytes)
        assert torch.allclose(torch.tensor(b64.embedding), torch.tensor(flt.embedding),
                              atol=1e-5)
    by_ids = client.embeddings.create(model=model, input=token_ids[1], encoding_format="float")
    many = client.embeddings.create(model=model, input=token_ids[:2], encoding_format="float")
    assert by_ids.usage.prompt_tokens == len(token_ids[1])
    assert cosine(by_ids.data[0].embedding, floats.data[1].embedding) > 0.99999
    assert cosine(many.data[0].embedding, floats.data[0].embedding) > 0.99999
    one = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and cosine(one.data[0].embedding, floats.data[0].embedding) > 0.99999


def test_langchain_openai_embeddings(server, client):
    from langchain_openai import OpenAIEmbeddings

    model = client.models.list().data[0].id
    lc = OpenAIEmbeddings(model=model, base_url=server.url + "/v1", api_key=KEY,
                          check_embedding_ctx_length=False, max_retries=0)
    docs = lc.embed_documents(TEXTS[:2])
    query = lc.embed_query(TEXTS[1])
    direct = client.embeddings.create(model=model, input=TEXTS[:2], encoding_format="float")
    assert len(docs) == 2 and len(docs[0]) == 576
    for got, want in zip(docs, direct.data):
        assert cosine(got, want.embedding) > 0.99999
    assert cosine(query, direct.data[1].embedding) > 0.99999


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "invalid value for input"),
    ({"input": ""}, "invalid value for input"),
    ({"input": 5}, "invalid value for input"),
    ({"input": [1, "a"]}, "invalid value for input"),
    ({"input": [[]]}, "invalid value for input"),
    ({}, "missing required field: input"),
    ({"input": "hi", "encoding_format": "int8"}, "invalid value for encoding_format"),
    ({"input": "hi", "dimensions": 64},
     "does not support dimensions=64: its embeddings have 576 dimensions"),
    ({"input": "hi", "dimensions": "64"}, "invalid value for dimensions"),
    ({"input": [[1] * (MAX_MODEL_LEN + 1)]},
     f"the prompt has {MAX_MODEL_LEN + 1} tokens, but the model's context is "
     f"{MAX_MODEL_LEN} tokens"),
    ({"input": "word " * 100000}, "characters, but the model's context is"),
    ({"input": [10 ** 9]}, "token id 1000000000 is out of range"),
])
def test_bad_input_is_a_400_in_openai_shape(server, body, message):
    resp = post(server, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


def test_key_model_and_no_blocks_left(server):
    assert post(server, {"input": "hi"}, key=None).status_code == 401
    assert post(server, {"input": "hi"}, key="wrong").json()["error"]["code"] == \
        "invalid_api_key"
    missing = post(server, {"input": "hi", "model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert post(server, {"input": ["a", "b", "c"]}).status_code == 200
    text = httpx.get(server.url + "/metrics").text
    running = [line for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc"))]
    assert running and all(line.endswith(" 0.0") for line in running), running
