"""Speculative decoding (n-gram and draft-model proposers) on tiny random models: greedy
output token-identical to plain decoding under preemption (recompute and swap) with the
block manager's invariants after every step, stops and max_tokens landing mid-window, n>1
forks, logprobs of accepted tokens, streaming; the configuration's errors."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.config import SpeculativeConfig
from pagedllm.engine.ngram_proposer import propose_ngram
from pagedllm.engine_args import EngineArgs

NUM_PROMPTS, MAX_TOKENS = 32, 64
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 256}
# A draft of another size: its proposals are mostly rejected.
SMALL = {**TINY, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "intermediate_size": 32}

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    paths = {}
    for name, config in (("target", TINY), ("small", SMALL)):
        paths[name] = str(root / f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(config, f)
    return paths

@pytest.fixture(scope="module")
def prompts():
    """Prompts that repeat a random phrase, so n-gram lookup finds matches (random models
    drift into loops of their own too)."""
    rng = random.Random(0)
    out = []
    for _ in range(NUM_PROMPTS):
        phrase = [rng.randrange(97) for _ in range(rng.randrange(3, 12))]
        out.append((phrase * 8)[: rng.randrange(6, 40)])
    return out

def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 400)
    return LLM(path, load_format="dummy", swap_space=0.01, block_size=4, **kwargs)

def generate(llm: LLM, prompts, params, check_every_step=True):
    """Run through the engine step by step, checking the block manager after each step;
    returns the finished outputs in prompt order and every streamed output."""
    engine = llm.engine
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done, streamed = {}, []
    bm = engine.scheduler.block_manager
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.append(out)
            if out.finished:
                done[out.request_id] = out
        if check_every_step:
            bm.check_invariants()
            check_hashes_cover_kept_tokens(engine)
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks, "blocks leaked"
    return [done[str(i)] for i in range(len(prompts))], streamed

def check_hashes_cover_kept_tokens(engine):
    """Every prefix-cache entry of a running sequence holds its own tokens: never a
    rejected proposal's."""
    bm = engine.scheduler.block_manager
    bs = bm.block_size
    for group in engine.scheduler.running:
        for seq in group.get_unfinished_seqs():
            tokens = seq.get_token_ids()
            hashes = bm.computed_hashes.get(seq.seq_id, [])
            assert len(hashes) * bs <= seq.num_computed_tokens
            for i, content in enumerate(hashes):
                assert list(content.token_ids) == tokens[i * bs: (i + 1) * bs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

@pytest.fixture(scope="module")
def reference(models, prompts):
    outs, _ = generate(make_llm(models["target"]), prompts, GREEDY, check_every_step=False)
    return [o.outputs[0].token_ids for o in outs]

def ngram(k=4, **extra):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, **extra}

def draft(path, k=3):
    return {"method": "draft_model", "model": path, "load_format": "dummy",
            "num_speculative_tokens": k}

# 60 blocks x 4 tokens: far less than 32 requests of up to 104 tokens need at once.
CASES = {
    "ngram-recompute": (lambda m: ngram(), dict(num_gpu_blocks_override=60)),
    "ngram-swap": (lambda m: ngram(), dict(num_gpu_blocks_override=60, preemption_mode="swap")),
    "ngram-chunked-prefill": (lambda m: ngram(k=5), dict(max_num_batched_tokens=24)),
    "draft-small-swap": (lambda m: draft(m["small"]),
                         dict(num_gpu_blocks_override=60, preemption_mode="swap")),
    "draft-small-recompute": (lambda m: draft(m["small"]), dict(num_gpu_blocks_override=60)),
    "draft-is-target": (lambda m: draft(m["target"], k=4), dict(num_gpu_blocks_override=60)),
}

@pytest.mark.parametrize("name", list(CASES))
def test_greedy_is_token_identical_to_plain_decoding(name, models, prompts, reference):
    spec, kwargs = CASES[name]
    llm = make_llm(models["target"], speculative_config=spec(models), **kwargs)
    outs, _ = generate(llm, prompts, GREEDY)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i}"
    stats = llm.engine.get_stats()
    assert stats.spec_num_verified_rows > 0
    if "num_gpu_blocks_override" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0, "the small cache should preempt"
    if name == "draft-is-target":
        assert stats.spec_acceptance_rate > 0.95  # 1.0 but for float near-ties
        assert stats.spec_mean_accepted_length > 3.5  # k + 1 but at max_tokens
    elif name.startswith("draft-small"):
        assert stats.spec_acceptance_rate < 0.5  # rejections happened
    else:
        assert 0.2 < stats.spec_acceptance_rate < 1.0
        assert stats.spec_mean_accepted_length > 1.5

def test_max_tokens_and_stop_tokens_mid_window(models, prompts, reference):
    """A window whose accepted tokens run past max_tokens or a stop token is cut there."""
    llm = make_llm(models["target"], speculative_config=ngram(k=6))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (5, 7, 11, 13)]
    stops = []
    for ref in reference[:4]:
        stop = ref[9]  # stop at the first occurrence of the 10th token
        stops.append(ref[: ref.index(stop) + 1])
        params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                     stop_token_ids=[stop]))
    outs, _ = generate(llm, prompts[:4] * 2, params)
    for i in range(4):
        assert outs[i].outputs[0].token_ids == reference[i][: params[i].max_tokens]
        assert outs[i].outputs[0].finish_reason == "length"
        assert outs[4 + i].outputs[0].token_ids == stops[i]
        assert outs[4 + i].outputs[0].finish_reason == "stop"
    assert llm.engine.get_stats().spec_mean_accepted_length > 1.5

def test_logprobs_are_the_targets_and_streaming_adds_up(models, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain, _ = generate(make_llm(models["target"]), prompts[:6], params)
    llm = make_llm(models["target"], speculative_config=ngram())
    outs, streamed = generate(llm, prompts[:6], params)
    for a, b in zip(plain, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank
    # Streaming: each output carries the window's new tokens as one delta; together they
    # are the whole output, and some windows carried several tokens.
    tokens: dict[str, list[int]] = {}
    widths = []
    for out in streamed:
        (_, ids), = out.deltas
        tokens.setdefault(out.request_id, []).extend(ids)
        widths.append(len(ids))
    assert [tokens[str(i)] for i in range(6)] == [o.outputs[0].token_ids for o in outs]
    assert max(widths) > 1

@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_forks_n_and_best_of(models, prompts, reference, method):
    spec = ngram() if method == "ngram" else draft(models["small"])
    llm = make_llm(models["target"], speculative_config=spec, num_gpu_blocks_override=80)
    greedy_n = SamplingParams(temperature=0.0, n=2, max_tokens=32, ignore_eos=True)
    outs, _ = generate(llm, prompts[:4], greedy_n)
    for out, ref in zip(outs, reference):
        assert [o.token_ids for o in out.outputs] == [ref[:32]] * 2
    sampled = SamplingParams(temperature=0.8, n=2, best_of=3, max_tokens=20, seed=1,
                             ignore_eos=True)
    outs, _ = generate(llm, prompts[:4], sampled)
    assert all(len(out.outputs) == 2 and all(len(o.token_ids) == 20 for o in out.outputs)
               for out in outs)
    assert llm.engine.get_stats().spec_num_verified_rows > 0

@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_disable_by_batch_size(models, prompts, reference, method):
    """Above 4 running sequences the steps are plain, here multi-step decode windows with
    async scheduling (as on CUDA); speculation resumes once few enough are left. The draft
    model (= the target) skips the plain steps and catches up in one chunk: still every
    proposal is accepted."""
    spec = ngram() if method == "ngram" else draft(models["target"])
    llm = make_llm(models["target"], speculative_config={**spec, "disable_by_batch_size": 4},
                   num_scheduler_steps=4, async_scheduling=True)
    lengths = [8 * (i + 1) for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs, _ = generate(llm, prompts[:8], params)
    assert [o.outputs[0].token_ids for o in outs] == [r[:n] for r, n in zip(reference, lengths)]
    # Speculation started only once at most 4 sequences were left running (after token 32).
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_num_verified_rows <= 4 * 32
    if method == "draft":
        assert stats.spec_acceptance_rate > 0.95  # 1.0 but for float near-ties


def test_speculation_turns_off_past_a_batch_size_by_default(models):
    llm = make_llm(models["target"], speculative_config=ngram())
    assert llm.engine.spec_batch_limit == 8  # the CPU's default (CUDA: 32)
    llm = make_llm(models["target"], speculative_config={**ngram(), "disable_by_batch_size": 3})
    assert llm.engine.spec_batch_limit == 3


def test_ngram_proposer():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    # The longest suffix that matches wins; then the latest match of it.
    assert propose_ngram([7, 1, 2, 9, 5, 2, 8, 1, 2], 2, 1, 3) == [9, 5]
    assert propose_ngram([5, 2, 8, 6, 2], 2, 1, 3) == [8, 6]
    assert propose_ngram([1, 2, 3], 2, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([1, 2, 3, 1], 5, 2, 3) == []  # suffixes shorter than min do not count
    assert propose_ngram([4, 4, 4], 3, 1, 2) == [4]  # only what follows the match

@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "num_speculative_tokens": 2},
     "speculative_config: method must be one of 'ngram', 'draft_model', got 'medusa'"),
    ({"method": "ngram"}, "speculative_config: num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "speculative_config: num_speculative_tokens must be an integer >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2},
     "speculative_config: prompt_lookup_min (4) is more than prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
     "speculative_config: unknown key 'model' for method 'ngram'; known: "
     "disable_by_batch_size, method, num_speculative_tokens, prompt_lookup_max, "
     "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     "speculative_config: method 'draft_model' needs 'model' (a path, hub id or preset of "
     "the draft model)"),
    ('{"method": "ngram", ', "speculative_config is not valid JSON: Expecting property name "
     "enclosed in double quotes: line 1 column 21 (char 20)"),
])
def test_config_errors(config, message):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict(config)
    assert str(e.value) == message

def test_engine_args_combinations():
    args = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert args.speculative_config == SpeculativeConfig("ngram", 3)
    with pytest.raises(ValueError) as e:
        EngineArgs(speculative_config=ngram(), tensor_parallel_size=2)
    assert str(e.value) == ("speculative_config and tensor_parallel_size > 1 cannot be "
                            "combined (yet)")

def test_draft_model_must_share_the_vocabulary(models, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**SMALL, "vocab_size": 50}))
    with pytest.raises(ValueError) as e:
        make_llm(models["target"], speculative_config=draft(str(other)))
    assert str(e.value) == (f"speculative_config: the draft model {str(other)!r} has a "
                            f"vocabulary of 50 tokens, the target model 97: they must share "
                            f"the tokenizer")



def test_server_streams_windows_and_reports_acceptance(models, prompts, reference):
    import asyncio

    import httpx

    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    llm = make_llm(models["target"], speculative_config=ngram())

    async def main():
        aengine = AsyncLLMEngine(llm.engine)
        transport = httpx.ASGITransport(app=build_app(aengine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": prompts[0], "max_tokens": 32, "temperature": 0,
                    "ignore_eos": True, "stream": True, "logprobs": 1}
            events = []
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            metrics = (await client.get("/metrics")).text
        await aengine.shutdown()
        return events, metrics

    events, metrics = asyncio.run(main())
    tokens = [t for e in events for c in e["choices"] for t in (c.get("logprobs") or {})
              .get("tokens", [])]
    assert len(tokens) == 32
    values = {s.name: s.value for family in text_string_to_metric_families(metrics)
              for s in family.samples if "spec_decode" in s.name}
    assert 0 < values["pagedllm:spec_decode_acceptance_rate"] <= 1
    assert values["pagedllm:spec_decode_mean_accepted_length"] > 1
    assert values["vllm:spec_decode_num_draft_tokens_total"] >= \
        values["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert values["vllm:spec_decode_num_drafts_total"] > 0


def test_sampled_tokens_keep_the_targets_distribution(tmp_path):
    """The engine end to end with a draft model that samples (q kept for rejection
    sampling): over 8 tokens, the (first, second) token pairs of 2,000 requests follow the
    target's p(t1) p(t2 | t1) (chi-square, 63 degrees of freedom); the second token is the
    first one a speculative step produces."""
    vocab = 8
    paths = {}
    for name, config in (("target", TINY), ("small", SMALL)):
        paths[name] = str(tmp_path / f"{name}.json")
        (tmp_path / f"{name}.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    prompt = [1, 2, 3]
    plain = make_llm(paths["target"])
    full = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab)
    outs = plain.generate([prompt] + [prompt + [t] for t in range(vocab)], full, use_tqdm=False)

    def dist(out):
        (entry,) = out.outputs[0].logprobs
        return torch.tensor([entry[t].logprob for t in range(vocab)]).exp()

    p1 = dist(outs[0])
    joint = (p1[:, None] * torch.stack([dist(o) for o in outs[1:]])).flatten()
    del plain
    llm = make_llm(paths["target"], max_num_seqs=256, speculative_config={
        **draft(paths["small"], k=2), "disable_by_batch_size": 256})
    torch.manual_seed(0)
    n = 2000
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    pairs = torch.tensor([o.outputs[0].token_ids[0] * vocab + o.outputs[0].token_ids[1]
                          for o in outs])
    counts = torch.bincount(pairs, minlength=vocab * vocab).double()
    expected = joint.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 103.4  # the 0.999 quantile of chi-square with 63 degrees of freedom
    stats = llm.engine.get_stats()
    # Most second tokens came from a verified window (a few rows found no free slots).
    assert stats.spec_num_verified_rows > n * 3 // 4 and 0 < stats.spec_acceptance_rate < 1


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_penalties_and_min_tokens_apply_per_position(models, prompts, reference, method):
    """Each scored position sees the proposals before it as output: penalties and a
    pending min_tokens give the tokens plain decoding gives."""
    stop = reference[0][3]
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                             repetition_penalty=1.3, frequency_penalty=0.4,
                             presence_penalty=0.2),
              SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, min_tokens=12,
                             stop_token_ids=[stop])]
    plain, _ = generate(make_llm(models["target"]), [prompts[0]] * 2, params)
    spec = ngram() if method == "ngram" else draft(models["target"])
    llm = make_llm(models["target"], speculative_config=spec)
    outs, _ = generate(llm, [prompts[0]] * 2, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert len(outs[1].outputs[0].token_ids) >= 12
    assert llm.engine.get_stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["chat"]])
def test_cli_flag(command):
    from pagedllm.entrypoints.cli import build_parser

    flag = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}'
    args = build_parser().parse_args([*command, "--speculative-config", flag])
    assert EngineArgs.from_cli_args(args).speculative_config == SpeculativeConfig(
        "ngram", 3, disable_by_batch_size=8)


def test_stop_string_mid_window_on_the_default_model(default_llm):
    """Real text: a stop string that lands inside a window of accepted tokens cuts the
    output where plain decoding stops (the reference is the shared plain engine)."""
    prompt = [{"role": "user", "content": "Repeat exactly: one two three four five six seven "
               "eight nine ten eleven twelve"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    ref = default_llm.chat(prompt, greedy, use_tqdm=False)[0].outputs[0].text
    words = ref.split()
    assert len(words) > 8, ref
    stop = words[len(words) // 2]
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, speculative_config=ngram())
    # A constrained request in the same batch is not speculated (its mask covers one
    # position) and still follows its grammar.
    pattern = r"(one|two|three)( (one|two|three)){2}"
    constrained = SamplingParams(temperature=0.0, max_tokens=24,
                                 structured_outputs=StructuredOutputsParams(regex=pattern))
    out = llm.chat([prompt, prompt, prompt],
                   [greedy, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
                    constrained], use_tqdm=False)
    assert re.fullmatch(pattern, out[2].outputs[0].text), out[2].outputs[0].text
    assert out[0].outputs[0].text == ref
    plain_stop = default_llm.chat(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                         stop=[stop]), use_tqdm=False)
    assert out[1].outputs[0].text == plain_stop[0].outputs[0].text
    assert out[1].outputs[0].finish_reason == "stop"
    assert llm.engine.get_stats().spec_mean_accepted_length > 2
