"""LLMEngine / LLM behaviour on the default model: sampling features end to end."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagedllm import SamplingParams
from tests.paged_helpers import NEAR_TIE_ACROSS_BATCH_SHAPES, PagedRunner, assert_same_greedy

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _no_leaks(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert not llm.engine.has_unfinished_requests()


def test_best_of_returns_the_n_most_likely_samples(default_llm):
    params = SamplingParams(n=4, best_of=8, temperature=1.0, max_tokens=8, seed=7,
                            logprobs=0)
    out = default_llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    scores = [o.cumulative_logprob for o in out.outputs]
    assert scores == sorted(scores, reverse=True)
    # The same 8 samples, all returned: the 4 kept are the top 4 of them.
    every = SamplingParams(n=8, best_of=8, temperature=1.0, max_tokens=8, seed=7, logprobs=0)
    all8 = default_llm.generate(PROMPT, every, use_tqdm=False)[0]
    top4 = sorted((o.cumulative_logprob for o in all8.outputs), reverse=True)[:4]
    assert scores == pytest.approx(top4)
    # cumulative_logprob is the sum of the chosen tokens' logprobs.
    for o in out.outputs:
        total = sum(step[t].logprob for step, t in zip(o.logprobs, o.token_ids))
        assert o.cumulative_logprob == pytest.approx(total, abs=1e-4)
    _no_leaks(default_llm)


def test_seeded_sampling_is_reproducible(default_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234)
    a = default_llm.generate([PROMPT, "Hello"], params, use_tqdm=False)
    b = default_llm.generate(["Hello", PROMPT], params, use_tqdm=False)
    # The same batch in another row order: a BLAS may round a row differently, which moves a
    # sampled token only if its uniform draw lands within ~1e-7 of a boundary (odds ~1e-6).
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    c = default_llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=12, seed=99),
                             use_tqdm=False)
    assert c[0].outputs[0].token_ids != a[0].outputs[0].token_ids


def test_logprobs_equal_log_softmax_of_a_direct_forward(default_llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = default_llm.generate(PROMPT, params, use_tqdm=False)[0]
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    engine = default_llm.engine
    runner = PagedRunner(engine.worker.model, engine.model_config, num_blocks=16, block_size=16)
    expected = torch.log_softmax(runner.step({0: tokens}), dim=-1)
    n = len(out.prompt_token_ids)
    for i, step in enumerate(out.outputs[0].logprobs):
        row = expected[n - 1 + i]
        chosen = out.outputs[0].token_ids[i]
        assert step[chosen].logprob == pytest.approx(row[chosen].item(), abs=1e-4)
        assert step[chosen].rank == 1  # greedy
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(step)
    assert out.prompt_logprobs[0] is None
    for i in range(1, n):
        got = out.prompt_logprobs[i][tokens[i]].logprob
        assert got == pytest.approx(expected[i - 1, tokens[i]].item(), abs=1e-4)


def test_stop_string_split_across_tokens(default_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    full = default_llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0]
    tokenizer = default_llm.get_tokenizer()
    # Pick a stop string that straddles two generated tokens.
    pieces = [tokenizer.decode(full.token_ids[: i + 1], skip_special_tokens=True)
              for i in range(len(full.token_ids))]

    def straddling(i):  # last character of token i-1's text + first of token i's
        return pieces[i][len(pieces[i - 1]) - 1: len(pieces[i - 1]) + 1]

    cut = next(i for i in range(2, len(pieces))
               if len(pieces[i]) > len(pieces[i - 1]) > len(pieces[i - 2])
               and full.text.index(straddling(i)) == len(pieces[i - 1]) - 1)
    stop = straddling(cut)
    start = len(pieces[cut - 1]) - 1
    out = default_llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == full.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = default_llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                               include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full.text[: start + len(stop)]


@pytest.mark.parametrize("num_steps", [1, 4])
def test_streaming_deltas_add_up_to_the_text(default_llm, monkeypatch, num_steps):
    """As the server streams: an output per step (several tokens each in multi-step)."""
    engine = default_llm.engine
    monkeypatch.setattr(engine, "stream_outputs", True)
    monkeypatch.setattr(engine, "num_scheduler_steps", num_steps)
    engine.add_request(f"stream-{num_steps}", PROMPT,
                       SamplingParams(temperature=0.0, max_tokens=16, stop=["zzz"]))
    text, ids, final, num_outputs = "", [], None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.deltas[0][0]
            ids += out.deltas[0][1]
            final, num_outputs = out, num_outputs + 1
    assert final.finished and text == final.outputs[0].text and ids == final.outputs[0].token_ids
    assert len(ids) == 16
    # Multi-step: the prefill's token, then windows of 4 tokens (the last one stops at 3).
    assert num_outputs == (16 if num_steps == 1 else 5)


def test_abort_frees_blocks(default_llm):
    engine = default_llm.engine
    engine.add_request("abort-me", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() < \
        engine.scheduler.block_manager.num_total_gpu_blocks
    engine.abort_request("abort-me")
    _no_leaks(default_llm)


def test_bad_requests_get_clear_errors(default_llm):
    engine = default_llm.engine
    with pytest.raises(ValueError, match="the prompt is empty"):
        default_llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match=r"max_tokens \(9000\) plus the prompt"):
        default_llm.generate("hi", SamplingParams(max_tokens=9000))
    with pytest.raises(ValueError, match="out of range"):
        default_llm.generate([[1, 2, 10**9]], SamplingParams())
    too_many = engine.worker.num_gpu_blocks * engine.block_size
    with pytest.raises(ValueError, match="tokens of KV cache"):
        default_llm.generate("hi", SamplingParams(n=8, max_tokens=too_many // 8 + 64))
    _no_leaks(default_llm)


def test_chat_uses_the_chat_template(default_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = default_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16),
                           use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    template = default_llm.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == default_llm.get_tokenizer().encode(template)


def _record_multi_step_runs(engine, monkeypatch) -> list[int]:
    """The step count of every multi-step batch the worker runs."""
    runs: list[int] = []
    launch = engine.worker.execute

    def recording(batch):
        if batch.num_steps > 1:
            runs.append(batch.num_steps)
        return launch(batch)

    monkeypatch.setattr(engine.worker, "execute", recording)
    return runs


def test_multi_step_decoding_gives_the_single_step_results(default_llm, monkeypatch):
    """Decode steps run back to back (samples fed to the next step on the device) give the
    tokens, logprobs and stops of one scheduling step per token; samples past a stop are
    dropped; every lookahead block comes back."""
    prompts = [PROMPT, "Hello", "The capital of France is", "Count: 1, 2, 3, 4,"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=19, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=13, seed=5),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["."], logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=2),
    ]
    engine = default_llm.engine
    monkeypatch.setattr(engine, "num_scheduler_steps", 1)
    single = default_llm.generate(prompts, params, use_tqdm=False)
    runs = _record_multi_step_runs(engine, monkeypatch)
    monkeypatch.setattr(engine, "num_scheduler_steps", 4)
    multi = default_llm.generate(prompts, params, use_tqdm=False)
    # windows of 4, the last one ending with the max_tokens of the row with most left
    assert runs and set(runs[:-1]) == {4} and 1 < runs[-1] <= 4
    assert single[2].outputs[0].finish_reason == "stop"  # the stop string case stops early
    # Sequences that stop stay in the batch for the rest of a multi-step run, so later steps
    # may see other batch shapes (fp32 rounding apart). Every greedy token has a margin over
    # the runner-up far above that rounding, so the tokens (and texts) are equal.
    for i in (0, 2, 3):
        margins = [sorted((lp.logprob for lp in step.values()), reverse=True)
                   for step in single[i].outputs[0].logprobs]
        assert all(m[0] - m[1] > NEAR_TIE_ACROSS_BATCH_SHAPES for m in margins)
    for a, b in zip(single, multi):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob,
                                                                abs=1e-4)
    for got, want in zip(multi[0].outputs[0].logprobs, single[0].outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token, entry in got.items():
            assert entry.rank == want[token].rank
            assert entry.logprob == pytest.approx(want[token].logprob, abs=1e-4)
    _no_leaks(default_llm)


def test_min_tokens_counts_every_step_of_a_window(default_llm, monkeypatch):
    """A pending min_tokens keeps EOS out of each step of a decode window, and lets it in
    at the step where the count is reached (the worker counts the window's steps): with
    EOS favoured by a large logit_bias, the output is min_tokens tokens then EOS, as single
    steps give it."""
    engine = default_llm.engine
    bias = {e: 100.0 for e in engine.eos_token_ids}
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=10, logprobs=2,
                            logit_bias=bias)
    single = default_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    runs = _record_multi_step_runs(engine, monkeypatch)
    monkeypatch.setattr(engine, "num_scheduler_steps", 4)
    multi = default_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert 4 in runs  # the prefill's token, then windows of 4: steps 9-12 cross min_tokens
    for out in (single, multi):
        assert len(out.token_ids) == 11 and out.finish_reason == "stop"
        assert out.token_ids[-1] in engine.eos_token_ids
        assert not set(out.token_ids[:10]) & engine.eos_token_ids
    steps = [{t: lp.logprob for t, lp in step.items()} for step in single.logprobs]
    assert_same_greedy(multi.token_ids, single.token_ids, steps, NEAR_TIE_ACROSS_BATCH_SHAPES)
    _no_leaks(default_llm)


def test_requests_that_read_their_own_output_decode_one_step_at_a_time(default_llm, monkeypatch):
    engine = default_llm.engine
    monkeypatch.setattr(engine, "num_scheduler_steps", 4)
    runs = _record_multi_step_runs(engine, monkeypatch)
    for params in (SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.2),
                   SamplingParams(temperature=0.0, max_tokens=6, n=2)):
        default_llm.generate(PROMPT, params, use_tqdm=False)
    assert runs == []
    _no_leaks(default_llm)


def _streamed_finals(engine, prompts, params) -> list:
    """The finished outputs of requests run with an output per step (the server's way,
    which appends each sample on its own)."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"per-token-{i}", prompt, p)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[f"per-token-{i}"] for i in range(len(prompts))]


def test_window_appends_stop_as_token_by_token_appends(default_llm, monkeypatch):
    """Offline, a decode window's samples are appended row by row (no SampleResult per
    token): the stops land where appending each sample on its own puts them (max_tokens
    mid-window, EOS at min_tokens, a stop token id with its stop_reason, ignore_eos)."""
    engine = default_llm.engine
    monkeypatch.setattr(engine, "num_scheduler_steps", 4)
    plain = default_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12),
                                 use_tqdm=False)[0].outputs[0].token_ids
    # A stop id: the first token of the plain output not seen before it, past the first window.
    stop_at = next(i for i in range(6, 12) if plain[i] not in plain[:i])
    eos_bias = {e: 100.0 for e in engine.eos_token_ids}
    prompts = [PROMPT, PROMPT, PROMPT, PROMPT, "Hello"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=6, logit_bias=eos_bias),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[plain[stop_at]]),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logit_bias=eos_bias),
        SamplingParams(temperature=0.8, max_tokens=10, seed=3),
    ]
    runs = _record_multi_step_runs(engine, monkeypatch)
    offline = [o.outputs[0] for o in default_llm.generate(prompts, params, use_tqdm=False)]
    assert 4 in runs
    monkeypatch.setattr(engine, "stream_outputs", True)
    streamed = [o.outputs[0] for o in _streamed_finals(engine, prompts, params)]
    assert [len(o.token_ids) for o in offline] == [7, 7, stop_at + 1, 9, 10]
    assert offline[2].stop_reason == plain[stop_at] and offline[1].stop_reason is None
    assert [o.finish_reason for o in offline] == ["length", "stop", "stop", "length", "length"]
    for a, b in zip(offline, streamed):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    _no_leaks(default_llm)


def test_steps_run_with_the_heap_frozen(default_llm, monkeypatch):
    """The garbage collector skips the objects alive when an engine first stepped, while
    it works and while it is idle; once an engine is dropped they are unfrozen (its model
    is collectable) and frozen again at the next step, also where the process froze a few
    objects of its own first (as some Python builds do at startup)."""
    from pagedllm import LLM
    from pagedllm.engine import llm_engine

    engine = default_llm.engine
    seen: list[int] = []
    step = engine._step

    def recording():
        seen.append(gc.get_freeze_count())
        return step()

    monkeypatch.setattr(engine, "_step", recording)
    engine.add_request("frozen", PROMPT, SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen and min(seen) > 0 and gc.get_freeze_count() > 0  # idle: still frozen
    other = LLM(model="smollm2-135m", load_format="dummy", kv_cache_memory=1 << 24)
    other.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    model = weakref.ref(other.engine.worker.model)
    del other
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert model() is None
    default_llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
    assert gc.get_freeze_count() > 0
    llm_engine._unfreeze_heap()  # as shutdown() does
    gc.freeze()  # the process's own
    later = {id(x): x for x in ([] for _ in range(100))}  # made after the process's freeze

    def collectable() -> int:
        return sum(id(x) in later for x in gc.get_objects())

    try:
        assert collectable() == len(later)
        default_llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
        assert collectable() == 0  # the engine froze them too
    finally:
        # Both freezes undone and the engine told so: its next step freezes the heap anew
        # (a bare gc.unfreeze would leave the tests after this one unfrozen for good).
        llm_engine._unfreeze_heap()
