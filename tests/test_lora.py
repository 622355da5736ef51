"""LoRA adapters (issue 35): PEFT adapters made over the default model's architecture with
seeded random weights; pagedllm's greedy fp32 output under an adapter is transformers + peft
(merged), rows of several adapters and the base share steps as if each ran alone, the prefix
cache never crosses adapters, and bad adapters are refused by name."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.engine.lora_adapters import NOT_ENABLED
from pagedllm.engine.lora_slots import LoRASlots
from pagedllm.engine.sequence import Sequence, SequenceGroup
from tests.paged_helpers import (
    NEAR_TIE_ACROSS_BATCH_SHAPES, NEAR_TIE_VS_TRANSFORMERS, assert_same_greedy, hf_greedy_reference,
)
from tests.prompts import mixed_prompts

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, targets). "c" has a smaller rank than the slots (zero-padded) and
# leaves parts of the fused projections out (k of qkv, gate/up entirely).
ADAPTERS = {"a": (1, 8, ALL_TARGETS), "b": (2, 8, ALL_TARGETS),
            "c": (3, 4, ["q_proj", "v_proj", "down_proj"])}
# Large enough that the adapter changes the continuations, small enough that they stay text.
LORA_STD = 0.04
MAX_TOKENS = 32
PROMPTS = mixed_prompts()[8:24]  # 8 openings, 8 sharing a long prefix
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
STORY = ("Once there was a lighthouse keeper who lived alone on a rocky island far out at sea. "
         "Every night he climbed the stairs to light the lamp, and every morning he wrote in "
         "his journal about the ships he had seen. One stormy evening")


def make_adapter(base, path, seed: int, rank: int, targets: list[str]):
    """get_peft_model over `base` with seeded random A and B, saved with save_pretrained;
    returns the peft model."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_STD)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def adapters(hf_reference, tmp_path_factory):
    """name -> (LoRARequest, transformers+peft merged greedy references): all 16 prompts
    for "a", the first 2 for "c" ("b" is checked against pagedllm alone)."""
    import transformers

    model, tokenizer = hf_reference
    folder = model.config._name_or_path  # the oracle's saved copy (conftest.hf_reference)
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i, (name, (seed, rank, targets)) in enumerate(ADAPTERS.items()):
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        peft_model = make_adapter(base, root / name, seed, rank, targets)
        prompts = {"a": PROMPTS, "c": PROMPTS[:2]}.get(name, [])
        merged = peft_model.merge_and_unload().eval()
        refs = hf_greedy_reference(merged, tokenizer, prompts, MAX_TOKENS) if prompts else []
        out[name] = (LoRARequest(f"adapter-{name}", i + 1, str(root / name)), refs)
        del merged, peft_model, base
    return out


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=256 << 20, dtype="float32", enable_lora=True, max_loras=2,
               max_lora_rank=8)


def request_of(adapters, name):
    return None if name is None else adapters[name][0]


def test_adapter_matches_transformers_peft_merged(llm, adapters):
    for name in ("a", "c"):
        lora, refs = adapters[name]
        prompts = PROMPTS[:len(refs)]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
        for i, (out, (ref, ref_logprobs)) in enumerate(zip(outs, refs)):
            assert_same_greedy(out.outputs[0].token_ids, ref, ref_logprobs,
                               NEAR_TIE_VS_TRANSFORMERS, f"adapter {name}, prompt {i}:")
    base = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert all(b.outputs[0].token_ids != ref for b, (ref, _) in zip(base, adapters["a"][1])), \
        "the adapter should change the continuations"


def alone(llm, prompt, lora):
    """One request on an otherwise idle engine: its tokens and each step's logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    (out,) = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
    steps = [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]
    return out.outputs[0].token_ids, steps


def test_mixed_batch_gives_each_row_its_tokens_alone(llm, adapters):
    # Three adapters and the base over two slots: rows wait for a slot, then share steps.
    names = [None, "a", "b", "c"]
    prompts = PROMPTS[::4]
    loras = [request_of(adapters, n) for n in names]
    mixed = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for i, (prompt, lora, out) in enumerate(zip(prompts, loras, mixed)):
        tokens, logprobs = alone(llm, prompt, lora)
        assert_same_greedy(out.outputs[0].token_ids, tokens, logprobs,
                           NEAR_TIE_ACROSS_BATCH_SHAPES, f"row {i} ({names[i]}):")


def test_more_adapters_than_slots_wait(llm, adapters):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, name in enumerate(["a", "b", "c", None]):
        engine.add_request(f"wait-{i}", PROMPTS[i], params,
                           lora_request=request_of(adapters, name))
    engine.step()
    scheduler = engine.scheduler
    # a and b hold the two slots; c waits (and the base request behind it, first come
    # first served) until one of them finishes.
    assert [g.request_id for g in scheduler.running] == ["wait-0", "wait-1"]
    assert [g.request_id for g in scheduler.waiting] == ["wait-2", "wait-3"]
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {f"wait-{i}" for i in range(4)}


def test_slots_evict_the_least_recently_used_idle_adapter():
    slots = LoRASlots(2)

    def group(lora_id: int) -> SequenceGroup:
        g = SequenceGroup(f"r{lora_id}", [Sequence(lora_id, [1], 16)], GREEDY)
        g.lora_request = LoRARequest(f"l{lora_id}", lora_id, f"/adapters/{lora_id}")
        return g

    g1, g2, g3 = group(1), group(2), group(3)
    assert slots.acquire(g1, []) and slots.acquire(g2, [g1])
    assert not slots.acquire(g3, [g1, g2])  # both slots in use: waits
    assert slots.acquire(g1, [g2])  # a hit refreshes adapter 1
    assert slots.acquire(g3, [g1])  # 2 is idle and least recently used
    assert slots.slot_ids == [1, 3]
    assert not slots.acquire(group(4), [g1, g3])


def test_prefix_cache_is_keyed_by_adapter(llm, adapters):
    # A prompt no other test ran: its blocks are cached only by the runs below.
    prompt = STORY
    lora_a, lora_b = adapters["a"][0], adapters["b"][0]
    (base,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    (first_a,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora_a)
    assert first_a.num_cached_tokens == 0, "KV computed by the base must not serve adapter a"
    (first_b,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora_b)
    assert first_b.num_cached_tokens == 0, "KV computed under a must not serve adapter b"
    (again_a,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora_a)
    assert again_a.num_cached_tokens >= 32
    assert again_a.outputs[0].token_ids == first_a.outputs[0].token_ids
    assert first_a.outputs[0].token_ids != base.outputs[0].token_ids


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_adapters_matches_transformers(adapters, mode):
    # 10 blocks x 16 tokens: far less than the 8 prompts need at once.
    llm = LLM(num_gpu_blocks_override=10, preemption_mode=mode, dtype="float32",
              enable_lora=True, max_loras=2, max_lora_rank=8)
    lora, refs = adapters["a"]
    prompts = PROMPTS[:8]
    loras = [lora if i % 2 else adapters["b"][0] for i in range(len(prompts))]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for i in range(1, len(prompts), 2):
        ref, ref_logprobs = refs[i]
        assert_same_greedy(outs[i].outputs[0].token_ids, ref, ref_logprobs,
                           NEAR_TIE_VS_TRANSFORMERS, f"prompt {i}, {mode}:")
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny cache should force preemption"


def tiny_adapter(path, rank: int = 8, hidden: int = 64):
    """An adapter of q_proj alone (one layer) over a Llama far smaller than the default."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=256)
    make_adapter(transformers.LlamaForCausalLM(config), path, 0, rank, ["q_proj"])
    return str(path)


def test_lora_request_without_enable_lora(default_llm, adapters):
    with pytest.raises(ValueError) as error:
        default_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False,
                             lora_request=adapters["a"][0])
    assert str(error.value) == NOT_ENABLED


def test_bad_adapters_are_refused_by_name(llm, adapters, tmp_path):
    a_path = adapters["a"][0].lora_path
    cases = [
        (LoRARequest("gone", 90, str(tmp_path / "nowhere")),
         f"LoRA adapter 'gone': path {str(tmp_path / 'nowhere')!r} is not a directory"),
        (LoRARequest("tiny", 91, tiny_adapter(tmp_path / "tiny")),
         "LoRA adapter 'tiny': tensor 'base_model.model.model.layers.0.self_attn.q_proj."
         "lora_A.weight' has shape (8, 64), the base model needs (8, 576)"),
        (LoRARequest("wide", 92, tiny_adapter(tmp_path / "wide", rank=16)),
         "LoRA adapter 'wide' has rank 16, above max_lora_rank 8"),
        (LoRARequest("again", adapters["a"][0].lora_int_id, a_path),
         f"lora_int_id {adapters['a'][0].lora_int_id} is already used by adapter "
         f"'adapter-a'"),
    ]
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=adapters["a"][0])
    for request, message in cases:
        with pytest.raises(ValueError) as error:
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=request)
        assert str(error.value) == message
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest or a list of"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request="adapter-a")
    with pytest.raises(ValueError, match="got 1 lora requests for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[None])
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1, got 0"):
        LoRARequest("zero", 0, a_path)


KEY = "sk-lora-0123"


@pytest.fixture(scope="module")
def lora_server(adapters):
    from tests.test_server import serve

    a, b = adapters["a"][0].lora_path, adapters["b"][0].lora_path
    yield from serve(["--dtype", "float32", "--kv-cache-memory", str(128 << 20),
                      "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                      "--api-key", KEY, "--lora-modules", f"adapter-a={a}", f"adapter-b={b}"])


def offline_text(llm, prompt: str, lora, max_tokens: int = 16) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def test_server_streams_each_adapter_as_offline(lora_server, llm, adapters):
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=lora_server.url + "/v1", api_key=KEY, max_retries=0)
    prompt = PROMPTS[1]

    async def stream(model: str) -> str:
        chunks = await client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                                 temperature=0.0, stream=True)
        return "".join([c.choices[0].text async for c in chunks])

    async def main() -> tuple[list[str], list]:
        texts = await asyncio.gather(stream("adapter-a"), stream("adapter-b"))
        return texts, (await client.models.list()).data

    (text_a, text_b), models = asyncio.run(main())
    assert text_a == offline_text(llm, prompt, adapters["a"][0])
    assert text_b == offline_text(llm, prompt, adapters["b"][0])
    assert text_a != text_b
    base = models[0].id
    cards = {m.id: m for m in models}
    assert cards["adapter-a"].parent == base and cards["adapter-b"].parent == base
    assert cards["adapter-a"].root == adapters["a"][0].lora_path


def test_server_loads_and_unloads_adapters(lora_server, llm, adapters, tmp_path):
    import httpx

    url, auth = lora_server.url, {"Authorization": f"Bearer {KEY}"}
    c_path = adapters["c"][0].lora_path

    def post(path: str, body: dict, headers=auth) -> httpx.Response:
        return httpx.post(url + path, json=body, headers=headers, timeout=300)

    def complete(model: str) -> httpx.Response:
        return post("/v1/completions", {"model": model, "prompt": PROMPTS[1],
                                        "max_tokens": 16, "temperature": 0.0})

    body = {"lora_name": "adapter-c", "lora_path": c_path}
    assert post("/v1/load_lora_adapter", body, headers={}).status_code == 401
    loaded = post("/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'adapter-c' added successfully."
    card = httpx.get(url + "/v1/models/adapter-c", headers=auth).json()
    base = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
    assert (card["id"], card["parent"], card["root"]) == ("adapter-c", base, c_path)
    answer = complete("adapter-c")
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == offline_text(llm, PROMPTS[1],
                                                               adapters["c"][0])
    again = post("/v1/load_lora_adapter", body)
    assert (again.status_code, again.json()["error"]["message"]) == (
        400, "The lora adapter 'adapter-c' has already been loaded.")
    bad = [({"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")},
            f"LoRA adapter 'gone': path {str(tmp_path / 'nowhere')!r} is not a directory"),
           ({"lora_name": "wide", "lora_path": tiny_adapter(tmp_path / "wide", rank=16)},
            "LoRA adapter 'wide' has rank 16, above max_lora_rank 8"),
           ({"lora_name": "tiny", "lora_path": tiny_adapter(tmp_path / "tiny")},
            "LoRA adapter 'tiny': tensor 'base_model.model.model.layers.0.self_attn.q_proj."
            "lora_A.weight' has shape (8, 64), the base model needs (8, 576)")]
    for request, message in bad:
        refused = post("/v1/load_lora_adapter", request)
        assert (refused.status_code, refused.json()["error"]["message"]) == (400, message)
    unloaded = post("/v1/unload_lora_adapter", {"lora_name": "adapter-c"})
    assert unloaded.status_code == 200, unloaded.text
    assert complete("adapter-c").status_code == 404
    gone = httpx.get(url + "/v1/models/adapter-c", headers=auth)
    assert (gone.status_code, gone.json()["error"]["message"]) == (
        404, "The model `adapter-c` does not exist.")
    missing = post("/v1/unload_lora_adapter", {"lora_name": "adapter-c"})
    assert (missing.status_code, missing.json()["error"]["message"]) == (
        404, "The lora adapter 'adapter-c' cannot be found.")


def lora_info(url: str) -> list:
    """The samples of vllm:lora_requests_info in /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return [sample for family in text_string_to_metric_families(text)
            if family.name == "vllm:lora_requests_info" for sample in family.samples]


def test_metrics_name_the_running_and_waiting_adapters(lora_server, adapters):
    import asyncio
    import contextlib
    import time

    import httpx
    import openai

    url, auth = lora_server.url, {"Authorization": f"Bearer {KEY}"}
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    base = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
    # A third adapter over the two slots: its request waits while a and b run.
    c = {"lora_name": "adapter-c2", "lora_path": adapters["c"][0].lora_path}
    assert httpx.post(url + "/v1/load_lora_adapter", json=c, headers=auth,
                      timeout=300).status_code == 200
    long = dict(prompt=PROMPTS[2], max_tokens=400, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True})

    async def labels_once(want: dict, deadline: float) -> dict:
        while True:
            (sample,) = await asyncio.to_thread(lora_info, url)
            if all(sample.labels[k] == v for k, v in want.items()) or time.time() > deadline:
                return sample

    async def main() -> tuple:
        streams = [await client.completions.create(model=m, **long)
                   for m in ("adapter-a", "adapter-b")]
        for stream in streams:  # both have a token: both run
            await stream.__anext__()
        waiter = asyncio.ensure_future(client.completions.create(model="adapter-c2", **long))
        busy = await labels_once({"waiting_lora_adapters": "adapter-c2"}, time.time() + 120)
        for stream in streams:
            await stream.close()
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await (await waiter).close()  # its stream, if it had started one
        idle = await labels_once({"running_lora_adapters": "", "waiting_lora_adapters": ""},
                                 time.time() + 120)
        return busy, idle

    busy, idle = asyncio.run(main())
    assert busy.labels == {"model_name": base, "max_lora": "2",
                           "running_lora_adapters": "adapter-a,adapter-b",
                           "waiting_lora_adapters": "adapter-c2"}
    assert abs(busy.value - time.time()) < 300  # the unix time it was set
    assert idle.labels == {"model_name": base, "max_lora": "2", "running_lora_adapters": "",
                           "waiting_lora_adapters": ""}
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "adapter-c2"},
                      headers=auth).status_code == 200


def test_one_base_takes_base_model_optionally(lora_server, adapters):
    import httpx

    url, auth = lora_server.url, {"Authorization": f"Bearer {KEY}"}
    base = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
    path = adapters["c"][0].lora_path

    def load(body: dict) -> httpx.Response:
        return httpx.post(url + "/v1/load_lora_adapter", json={"lora_path": path, **body},
                          headers=auth, timeout=300)

    wrong = load({"lora_name": "adapter-c3", "base_model": "nope"})
    assert (wrong.status_code, wrong.json()["error"]) == (404, {
        "message": f"The base model `nope` does not exist; this server serves: {base}",
        "type": "invalid_request_error", "param": "base_model", "code": "model_not_found"})
    like_base = load({"lora_name": base})
    assert (like_base.status_code, like_base.json()["error"]["message"]) == (
        400, f"The lora adapter '{base}' cannot be loaded: '{base}' is the name of a served "
        "base model.")
    assert load({"lora_name": "adapter-c3", "base_model": base}).status_code == 200
    unloaded = httpx.post(url + "/v1/unload_lora_adapter", headers=auth,
                          json={"lora_name": "adapter-c3", "base_model": base})
    assert unloaded.status_code == 200, unloaded.text
