"""The OpenAI-compatible server, end to end: a real `pagedllm serve` in a subprocess, driven by
the official `openai` client (and raw httpx where the wire format itself is under test)."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.sampling_params import SamplingParams
from tests.paged_helpers import NEAR_TIE_ACROSS_BATCH_SHAPES
from tests.prompts import mixed_prompts

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 4096
NUM_BLOCKS = 160  # 2560 tokens of KV cache: less than the context, so both limits are testable
SERVER_ARGS = [
    "--dtype", "float32",  # the same weights as the default_llm fixture it is compared with
    "--max-model-len", str(MAX_MODEL_LEN),
    "--num-gpu-blocks-override", str(NUM_BLOCKS),
    "--swap-space", "0.05",
]


class ServerProcess:
    """`pagedllm serve --port 0 ...` in a child process; the URL is read from its stdout."""

    def __init__(self, args: list[str], timeout: float = 300) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
        )
        self.stdout_lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.timeout = timeout
        self._url: str | None = None

    def wait_ready(self) -> str:
        """Wait for the server to print its URL (it boots in the background until then)."""
        if self._url is None:
            self._url = self._wait_for_url(self.timeout)
        return self._url

    @property
    def url(self) -> str:
        return self.wait_ready()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.put(line)
        self.stdout_lines.put(None)

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.stdout_lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            found = re.search(r" at (http://127\.0\.0\.1:\d+)", line)
            if found:
                return found.group(1)
        self.close()
        self.stderr.seek(0)
        raise RuntimeError(f"the server did not start:\n{self.stderr.read()}")

    def read_stderr(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def serve(args: list[str]):
    """A module fixture's body: a ready server, closed afterwards with no traceback logged."""
    srv = ServerProcess(args)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()
    assert "Traceback" not in srv.read_stderr()


@pytest.fixture(scope="module")
def server():
    yield from serve(SERVER_ARGS)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    return default_llm.get_tokenizer()


def chat_prompt_ids(llm, messages: list[dict]) -> list[int]:
    text = llm.engine.apply_chat_template(messages, add_generation_prompt=True)
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def scrape(url: str) -> dict[str, float]:
    """Sample name -> value of every series labelled with model_name alone (so neither a
    histogram's buckets nor request_success by finished_reason)."""
    text = httpx.get(url + "/metrics").text
    return {sample.name: sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if set(sample.labels) == {"model_name"}}


# ---------------------------------------------------------------------- basics


def test_models_health_and_root_routes(server, model):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == model and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_shape_and_usage(client, model, tokenizer):
    prompt = "The three primary colors are"
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                     logprobs=0)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", resp.id)
    assert resp.object == "text_completion" and resp.model == model
    assert abs(resp.created - time.time()) < 600
    (choice,) = resp.choices
    assert choice.index == 0 and choice.text
    assert resp.usage.prompt_tokens == len(tokenizer.encode(prompt))
    # One logprob entry per generated token: the count the usage reports.
    assert resp.usage.completion_tokens == len(choice.logprobs.tokens)
    assert "".join(choice.logprobs.tokens) == choice.text
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    if choice.finish_reason == "length":
        assert resp.usage.completion_tokens == 8


def test_completion_stream_matches_non_stream(client, model):
    kwargs = dict(model=model, prompt="Once upon a time, in a land far away,", max_tokens=12,
                  temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == []
    assert usage_chunk.usage.model_dump() == full.usage.model_dump()


def clear_greedy_margins(logprobs) -> bool:
    """Whether each greedy token beat the runner-up by more than another batch shape can move
    the logits (fp32 rounding): then the same text is due whatever the batch."""
    return all(best[0] - best[1] > NEAR_TIE_ACROSS_BATCH_SHAPES for best in (
        sorted(top.values(), reverse=True) for top in logprobs.top_logprobs))


def test_completion_batch_and_token_prompts(client, model, tokenizer):
    prompts = ["Hello", "The quick brown fox"]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    for prompt, choice in zip(prompts, batch.choices):
        single = client.completions.create(model=model, prompt=tokenizer.encode(prompt),
                                           max_tokens=6, temperature=0, logprobs=5)
        assert clear_greedy_margins(single.choices[0].logprobs)
        assert single.choices[0].text == choice.text
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)


def test_completion_echo_with_logprobs(client, model, tokenizer):
    prompt = "List three fruits:"
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                     echo=True, logprobs=2)
    choice = resp.choices[0]
    assert choice.text.startswith(prompt)
    n_prompt = len(tokenizer.encode(prompt))
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + resp.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, chosen, top in zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:],
                                  lp.top_logprobs[n_prompt:]):
        # Greedy: the chosen token is the most likely one; at most logprobs + 1 entries.
        assert 1 <= len(top) <= 3
        assert top[token] == pytest.approx(chosen) and chosen == pytest.approx(max(top.values()))


def test_chat_non_stream_and_stream_agree(client, model, default_llm):
    messages = [{"role": "user", "content": "Name a large animal."}]
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                          temperature=0)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", resp.id)
    assert resp.object == "chat.completion"
    message = resp.choices[0].message
    assert message.role == "assistant" and message.content
    assert resp.usage.prompt_tokens == len(chat_prompt_ids(default_llm, messages))

    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == resp.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_greedy_chat_equals_offline_llm(client, model, default_llm):
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    offline = default_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16),
                               use_tqdm=False)[0].outputs[0].text
    served = client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                            temperature=0).choices[0].message.content
    assert served == offline


def test_n_samples(client, model):
    prompt = "Write a haiku about the sea."
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=8, n=2,
                                     temperature=1.0, seed=7, logprobs=0)
    assert [c.index for c in resp.choices] == [0, 1]
    # The prompt counts once; every sample's tokens count.
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in resp.choices)
    single = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert resp.usage.prompt_tokens == single.usage.prompt_tokens
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, n=2,
        temperature=1.0, stream=True,
    )
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(texts.values())


def test_chat_logprobs(client, model):
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to three."}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == resp.choices[0].message.content


def test_stop_strings(client, model):
    kwargs = dict(model=model, prompt="The three primary colors are", max_tokens=16,
                  temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    cut = len(text) // 2
    stop = text[cut:cut + 3]
    cut = text.find(stop)
    stopped = client.completions.create(**kwargs, stop=[stop, "@@never@@"]).choices[0]
    assert stopped.text == text[:cut] and stopped.finish_reason == "stop"
    kept = client.completions.create(**kwargs, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:cut + len(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **kwargs, stop=stop, stream=True))
    assert streamed == text[:cut]


def test_seed_reproducible(client, model):
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt="Shopping list:\n1.", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_sampling_params_are_passed(client, model):
    # logit_bias forces a token; min_tokens + ignore_eos fix the length.
    forced = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={"42": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [client_decode(client, 42)] * 3
    fixed = client.completions.create(
        model=model, prompt="Hello", max_tokens=5, temperature=0.8, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 5,
                    "ignore_eos": True},
    )
    assert fixed.usage.completion_tokens == 5 and fixed.choices[0].finish_reason == "length"


def client_decode(client, token_id: int) -> str:
    url = str(client.base_url).removesuffix("/v1/")
    return httpx.post(url + "/detokenize", json={"tokens": [token_id]}).json()["prompt"]


def test_tokenize_detokenize(server, client, model, default_llm, tokenizer):
    prompt = "Translate to French: good morning"
    out = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()
    assert out["tokens"] == tokenizer.encode(prompt)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(server.url + "/detokenize", json={"tokens": out["tokens"]}).json()
    assert back == {"prompt": prompt}
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == chat_prompt_ids(default_llm, messages)
    usage = client.chat.completions.create(model=model, messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens == chat["count"]


# ---------------------------------------------------------------------- errors

LONG = "hello " * (MAX_MODEL_LEN + 100)
FITS_CONTEXT_NOT_CACHE = "hello " * 3000  # < 4096 context, > 2560 cache tokens

ERROR_CASES = [
    # (path, body or raw text, status, message fragment, param)
    ("/v1/completions", "{not json", 400, "malformed JSON", None),
    ("/v1/completions", {"max_tokens": 2}, 400, "missing required field: prompt", "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404,
     "The model `nope` does not exist.", "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"},
     404, "The model `gpt-9` does not exist.", "model"),
    # Ranges are in the schema: pydantic names the field and the bound.
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400,
     "invalid value for temperature: Input should be greater than or equal to 0", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400,
     "invalid value for top_p: Input should be less than or equal to 1", "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400,
     "invalid value for n: Input should be greater than or equal to 1", "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 30}, 400,
     "invalid value for logprobs: Input should be less than or equal to 20", "logprobs"),
    # What the schema cannot say, SamplingParams says.
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, 400,
     "best_of must be greater than or equal to n", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400,
     "min_tokens must be less than or equal to max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400,
     "out of range for a vocabulary", None),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix is not supported",
     "suffix"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, 400,
     f"but the model's context is {MAX_MODEL_LEN} tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400,
     f"more than the model's context of {MAX_MODEL_LEN} tokens", None),
    ("/v1/completions", {"prompt": FITS_CONTEXT_NOT_CACHE, "max_tokens": 8}, 400,
     f"the cache holds only {NUM_BLOCKS * 16} tokens", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "top_logprobs requires logprobs",
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400,
     "missing required field: messages.0.role", "messages.0.role"),
    ("/detokenize", {"tokens": [999_999]}, 400, "token id 999999 is out of range", "tokens"),
    # Requests the schema allowed and the server refused, now refused by the schema...
    ("/v1/completions", {"prompt": ""}, 400,
     "invalid value for prompt: String should have at least 1 character", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": ""}]}, 400,
     "invalid value for messages.0.role: Input tag '' found using 'role' does not match any "
     "of the expected tags: 'system', 'developer', 'user', 'assistant', 'tool'",
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400,
     "missing required field: messages.0.content", "messages.0.content"),
    ("/tokenize", {}, 400, "missing required field: prompt", "prompt"),
    # ...and requests the schema refused and the server took, now refused: no coercion.
    ("/detokenize", {"tokens": [False]}, 400,
     "invalid value for tokens.0: Input should be a valid integer", "tokens.0"),
    ("/detokenize", {"tokens": [-1]}, 400,
     "invalid value for tokens.0: Input should be greater than or equal to 0", "tokens.0"),
    ("/v1/completions", {"prompt": [[False]]}, 400,
     "invalid value for prompt.0.0: Input should be a valid integer", "prompt.0.0"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400,
     "invalid value for stream: Input should be a valid boolean", "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "invalid value for messages.0.content.0.type: Input should be 'text'",
     "messages.0.content.0.type"),
    # A lone surrogate (JSON can escape one, no UTF-8 text holds one) is a 400, not a 500.
    ("/v1/completions", r'{"prompt": "abc\ud800def", "max_tokens": 2}', 400,
     "prompt contains a lone surrogate, which is not valid Unicode", "prompt"),
    ("/v1/completions", r'{"prompt": ["ok", "abc\ud800def"], "max_tokens": 2, "stream": true}',
     400, "prompt.1 contains a lone surrogate", "prompt.1"),
    ("/tokenize", r'{"prompt": "abc\udfffdef"}', 400, "prompt contains a lone surrogate",
     "prompt"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}', 400,
     "messages.0.content contains a lone surrogate", "messages.0.content"),
    ("/v1/completions", r'{"prompt": "hi", "model": "\ud800"}', 400,
     "model contains a lone surrogate", "model"),
]


@pytest.mark.parametrize("path,body,status,message,param", ERROR_CASES,
                         ids=[f"{c[0]}:{c[3][:30]}" for c in ERROR_CASES])
def test_error_responses(server, client, model, path, body, status, message, param):
    if isinstance(body, str):
        resp = httpx.post(server.url + path, content=body,
                          headers={"Content-Type": "application/json"}, timeout=60)
    else:
        resp = httpx.post(server.url + path, json=body, timeout=60)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert message in error["message"]
    assert error["param"] == param
    # The server keeps serving.
    ok = client.completions.create(model=model, prompt="Hello", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_openai_client_sees_errors(client, model):
    with pytest.raises(openai.BadRequestError, match="invalid value for temperature"):
        client.completions.create(model=model, prompt="hi", temperature=-0.5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="missing", messages=[{"role": "user",
                                                                   "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="the cache holds only"):
        client.completions.create(model=model, prompt=FITS_CONTEXT_NOT_CACHE, max_tokens=8,
                                  stream=True)


# ------------------------------------------------------------------ hardening


def test_request_body_over_the_limit_is_answered_413_unread(server, client, model):
    pad = "x" * (9 << 20)  # over the default --max-request-bytes of 8 MiB
    body = json.dumps({"prompt": "hi", "max_tokens": 1, "pad": pad}).encode()

    def chunked():  # no Content-Length: the server must count what arrives
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]

    for content in (body, chunked()):
        resp = httpx.post(server.url + "/v1/completions", content=content, timeout=60,
                          headers={"Content-Type": "application/json"})
        assert resp.status_code == 413
        assert resp.json() == {"error": {
            "message": f"the request body is larger than this server's limit of {8 << 20} "
                       "bytes (`pagedllm serve --max-request-bytes`)",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
    assert client.completions.create(model=model, prompt="Hi", max_tokens=1).choices


class Stream:
    """A long greedy completion streamed in a thread, with the arrival time of each chunk."""

    def __init__(self, url: str) -> None:
        self.url, self.arrivals, self.stop = url, [], threading.Event()
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body,
                              timeout=120) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.arrivals.append(time.perf_counter())
                    if self.stop.is_set():
                        return
        except Exception as exc:
            self.error = exc

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while len(self.arrivals) < n and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.01)
        assert len(self.arrivals) >= n, self.error

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between chunks that overlap [start, end]."""
        a = self.arrivals
        return [b - p for p, b in zip(a, a[1:]) if b > start and p < end]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def longest_token(tokenizer) -> int:
    """No token is longer: a text of more than MAX_MODEL_LEN times this cannot fit."""
    return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))


def _stalls(stream: Stream, requests) -> list[tuple[httpx.Response, float]]:
    """Send requests one by one while the stream runs; each with the stream's longest gap
    while it was in flight."""
    stream.wait_tokens(10)
    results = []
    for send in requests:
        start = time.perf_counter()
        resp = send()
        end = time.perf_counter()
        stream.wait_tokens(len(stream.arrivals) + 3)
        results.append((resp, max(stream.gaps(start, end))))
    return results


def test_a_4mb_prompt_is_refused_before_tokenizing_and_stalls_no_stream(server, tokenizer):
    """Issue 13: tokenizing a 4 MB prompt on the engine's thread stalled streams for 6-10 s."""
    text = "a " * 2_000_000
    longest = longest_token(tokenizer)
    stream = Stream(server.url)
    try:
        stream.wait_tokens(10)
        before = stream.gaps(0, time.perf_counter())
        results = _stalls(stream, [
            lambda: httpx.post(server.url + "/v1/completions", timeout=120,
                               json={"prompt": text, "max_tokens": 2}),
            lambda: httpx.post(server.url + "/v1/chat/completions", timeout=120,
                               json={"messages": [{"role": "user", "content": text}]}),
            lambda: httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=120),
        ])
    finally:
        stream.close()
    bound = MAX_MODEL_LEN * longest
    for (resp, _), param in zip(results, ["prompt", "messages", "prompt"]):
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == param
        assert re.fullmatch(
            rf"the prompt has \d+ characters, but the model's context is {MAX_MODEL_LEN} tokens "
            rf"and no token is longer than {longest} characters \(at most {bound} characters\)",
            error["message"]), error["message"]
    typical = statistics.median(before)
    assert max(stall for _, stall in results) < max(0.5, 5 * typical), (results, typical)


def test_tokenizing_runs_off_the_engine_thread(server, tokenizer):
    """A text just under the character bound takes a second to tokenize: streams go on."""
    text = "a " * (MAX_MODEL_LEN * longest_token(tokenizer) // 2 - 1)
    stream = Stream(server.url)
    try:
        stream.wait_tokens(10)
        before = stream.gaps(0, time.perf_counter())
        results = _stalls(stream, [
            lambda: httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=120)
        ] * 2)
    finally:
        stream.close()
    for resp, _ in results:
        assert resp.status_code == 200 and resp.json()["count"] == len(text) // 2 + 1
    typical = statistics.median(before)
    assert max(stall for _, stall in results) < max(0.5, 5 * typical), (results, typical)


def test_tool_call_history_is_accepted_and_rendered_as_documented(server, client, model,
                                                                  default_llm):
    """An assistant turn with `content: null` + tool_calls, then the tool's result; this
    model's template knows no tools, so they are rendered as Hermes text (README)."""
    messages = [
        {"role": "developer", "content": "You can call tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": ""}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    ]
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                          temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")
    rendered = [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content":
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>\n"
                                    "<tool_response>\nnoon\n</tool_response>"},
    ]
    assert resp.usage.prompt_tokens == len(chat_prompt_ids(default_llm, rendered))
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == chat_prompt_ids(default_llm, rendered)


def test_unknown_fields_are_logged_once_per_name(server, client, model):
    for extra in ({"frobnicate": 1}, {"frobnicate": 2, "zorkmid": "x", "quux": None}):
        client.completions.create(model=model, prompt="Hi", max_tokens=1, extra_body=extra)
    log = server.read_stderr()
    assert log.count("CompletionRequest: ignoring the unknown field(s) 'frobnicate' "
                     "(logged once per field)") == 1
    assert log.count("CompletionRequest: ignoring the unknown field(s) 'quux', 'zorkmid' "
                     "(logged once per field)") == 1
    assert log.count("frobnicate") == 1


def test_openapi_schema_documents_what_the_server_answers(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = paths[path]["post"]["responses"]
        assert "422" not in responses
        for code in ("400", "404", "413"):  # no --api-key here: no 401
            assert responses[code]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}
        assert "401" not in responses
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    assert set(paths["/v1/completions"]["post"]["responses"]["200"]["content"]) == {
        "application/json", "text/event-stream"}
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]

    health = httpx.get(server.url + "/health")
    assert health.json() == {"status": "ok"}
    assert health.headers["content-type"] == "application/json"
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    wrong = httpx.get(server.url + "/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "Method Not Allowed"


# ----------------------------------------------------------- concurrency, metrics


def test_concurrent_streams_with_disconnects(server, client, model):
    prompts = mixed_prompts()
    assert len(prompts) == 32
    expected = asyncio.run(_non_streamed(server.url, model, prompts))
    streamed, aborted_chunks = asyncio.run(_streamed(server.url, model, prompts))
    for i in range(8, 32):  # other batches, the same greedy texts (margins checked)
        assert streamed[i] == expected[i], f"prompt {i}: {prompts[i]!r}"
    assert all(n == 2 for n in aborted_chunks)

    deadline = time.monotonic() + 10
    while True:
        metrics = scrape(server.url)
        idle = (metrics["vllm:num_requests_running"] == 0
                and metrics["vllm:num_requests_waiting"] == 0
                and metrics["vllm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, metrics


async def _non_streamed(url: str, model: str, prompts: list[str]) -> list[str]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                  timeout=300) as aclient:
        results = await asyncio.gather(*(
            aclient.completions.create(model=model, prompt=p, max_tokens=16, temperature=0,
                                       logprobs=5)
            for p in prompts
        ))
    assert all(clear_greedy_margins(r.choices[0].logprobs) for r in results[8:])
    return [r.choices[0].text for r in results]


async def _streamed(url: str, model: str, prompts: list[str]) -> tuple[list[str], list[int]]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                  timeout=300) as aclient:

        async def full(prompt: str) -> str:
            stream = await aclient.completions.create(model=model, prompt=prompt, max_tokens=16,
                                                      temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        async def leave_early(prompt: str) -> int:
            # Long enough that only an abort can end it within the test.
            stream = await aclient.completions.create(
                model=model, prompt=prompt, max_tokens=2000, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.close()
            return seen

        results = await asyncio.gather(*(leave_early(p) for p in prompts[:8]),
                                       *(full(p) for p in prompts[8:]))
    return [""] * 8 + list(results[8:]), list(results[:8])


def test_metrics_exposition(server, client, model, default_llm):
    before = scrape(server.url)
    resp = client.completions.create(model=model, prompt="Q: What is 2 + 2?\nA:", max_tokens=4,
                                     extra_body={"ignore_eos": True})
    after = scrape(server.url)
    assert after["vllm:generation_tokens_total"] - before.get(
        "vllm:generation_tokens_total", 0) == resp.usage.completion_tokens
    assert after["vllm:prompt_tokens_total"] - before.get(
        "vllm:prompt_tokens_total", 0) == resp.usage.prompt_tokens
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert after[f"vllm:{name}_count"] == before.get(f"vllm:{name}_count", 0) + 1, name
    assert after["vllm:request_prompt_tokens_sum"] - before.get(
        "vllm:request_prompt_tokens_sum", 0) == resp.usage.prompt_tokens
    assert after["vllm:request_generation_tokens_sum"] - before.get(
        "vllm:request_generation_tokens_sum", 0) == resp.usage.completion_tokens
    assert after["vllm:inter_token_latency_seconds_count"] >= before.get(
        "vllm:inter_token_latency_seconds_count", 0) + resp.usage.completion_tokens - 1
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "pagedllm:num_requests_swapped", "vllm:kv_cache_usage_perc",
                 "pagedllm:prefix_cache_hit_rate", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in after, name
    assert after["vllm:prefix_cache_hits_total"] <= after["vllm:prefix_cache_queries_total"]
    assert 0 <= after["pagedllm:prefix_cache_hit_rate"] <= 1
    assert after["pagedllm:model_weight_bytes"] == default_llm.engine.worker.weight_bytes


# What a vLLM Grafana dashboard asks Prometheus for (its panels' queries, $model_name the
# dashboard's variable); each must select series this server exports.
DASHBOARD_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket'
    '{model_name="$model_name"}[1m])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[1m]) / '
    'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[1m])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[1m])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[1m])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket'
    '{model_name="$model_name"}[1m])))',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket'
    '{model_name="$model_name"}[1m])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[1m]) / '
    'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[1m])',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[1m]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[1m]))',
    'sum by(finished_reason) (increase(vllm:request_success_total'
    '{model_name="$model_name"}[1m]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[1m])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[1m])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[1m])',
    'rate(vllm:num_preemptions_total{model_name="$model_name"}[1m])',
    'rate(vllm:prefix_cache_hits_total{model_name="$model_name"}[1m]) / '
    'rate(vllm:prefix_cache_queries_total{model_name="$model_name"}[1m])',
    'rate(vllm:spec_decode_num_accepted_tokens_total{model_name="$model_name"}[1m]) / '
    'rate(vllm:spec_decode_num_draft_tokens_total{model_name="$model_name"}[1m])',
    'rate(vllm:spec_decode_num_drafts_total{model_name="$model_name"}[1m])',
]
VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:request_success_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
]


def test_metrics_under_vllm_names_answer_a_dashboards_queries(server, client, model):
    client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    unlabelled = [s.name for s in samples if s.labels.get("model_name") != model]
    assert not unlabelled, f"series without model_name={model!r}: {unlabelled[:5]}"
    assert not [s.name for s in samples if not s.name.startswith(("vllm:", "pagedllm:"))]
    names = {s.name for s in samples}
    assert not [n for n in VLLM_NAMES if n not in names]
    by_length = [s for s in samples if s.name == "vllm:request_success_total"
                 and s.labels["finished_reason"] == "length"]
    assert by_length and by_length[0].value >= 1
    for query in DASHBOARD_QUERIES:
        query = query.replace("$model_name", model)
        grouped = re.findall(r"by ?\((\w+)\)", query)
        for name, selector in re.findall(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", query):
            wanted = dict(re.findall(r'(\w+)="([^"]*)"', selector))
            found = [s for s in samples if s.name == name
                     and wanted.items() <= s.labels.items()
                     and all(label in s.labels for label in grouped)]
            assert found, f"{query}: no series {name}{{{selector}}}"


def test_sse_wire_format(server, model):
    body = {"model": model, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert json.loads(event[6:])["object"] == "text_completion"


def test_bench_serve_against_running_server(server, capsys):
    from pagedllm.benchmarks import serve_bench

    code = serve_bench.main(["--url", server.url, "--num-clients", "4", "--num-requests", "6",
                             "--max-tokens", "3", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0
    assert summary["requests"] == 6 and summary["failed"] == 0
    assert summary["output_tokens"] == 18  # ignore_eos: exactly max_tokens each
    assert summary["requests_per_s"] > 0 and summary["output_tokens_per_s"] > 0
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    assert 0 < summary["itl_p50_ms"] <= summary["itl_p99_ms"]
