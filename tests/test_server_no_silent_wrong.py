"""No silent wrong answers (issue 29), through the real server and unmodified clients: every
request gets what it asked for or a clear error. Grammar limits are refused before generation
(400 naming the field and the limit) or, hit mid-way, end the choice with finish_reason
"error" (and an SSE error event, and a counter); a named tool_choice gives exactly one call;
extreme sampling values act as their limit or are refused; vLLM's continue_final_message and
prompt_logprobs on chat are honoured; a --max-model-len over the model's is refused."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pagedllm.structured_grammar import MAX_CHOICES, MAX_REGEX_REPEAT
from tests.test_server import REPO, scrape, serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# The README's get_weather example.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
REF_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
# Passes every check before generation, and llguidance's lexer gives up after a few tokens.
LIMIT_HIT_MID_WAY = "start: /a{1000000}/"


@pytest.fixture(scope="module")
def server():
    yield from serve(["--max-model-len", "2048", "--kv-cache-memory", str(32 << 20)])


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def post(server, path: str, **body) -> httpx.Response:
    if path == "chat":
        body.setdefault("messages", QUESTION)
    else:
        body.setdefault("prompt", "a")
    return httpx.post(f"{server.url}/v1/{'chat/completions' if path == 'chat' else path}",
                      json={"model": MODEL, "max_tokens": 8, **body}, timeout=120)


# ---- grammar limits, before generation ----


@pytest.mark.parametrize("body, param, message", [
    ({"guided_choice": [f"o{i}" for i in range(MAX_CHOICES + 1)]}, "guided_choice",
     f"guided_choice: choice has {MAX_CHOICES + 1} options; at most {MAX_CHOICES} are allowed"),
    ({"guided_regex": "a{1000000}"}, "guided_regex",
     f"guided_regex: regex repeats 1000000 times; at most {MAX_REGEX_REPEAT} repetitions"),
    ({"guided_json": REF_LOOP}, "guided_json",
     "guided_json: the grammar allows no output (NoExtensionBias); a recursive schema needs "
     "a branch that ends"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "b{20000}"}}}}, "response_format",
     "response_format: JSON schema pattern repeats 20000 times"),
    ({"structured_outputs": {"json": {"type": "string", "maxLength": 10 ** 6}}},
     "structured_outputs", f"structured_outputs: JSON schema maxLength is 1000000; at most "
     f"{MAX_REGEX_REPEAT}"),
    ({"guided_json": {"enum": list(range(MAX_CHOICES + 1))}}, "guided_json",
     f"guided_json: JSON schema enum has {MAX_CHOICES + 1} values"),
])
def test_grammar_over_a_limit_is_refused_before_generation(server, body, param, message):
    for path in ("chat", "completions"):
        r = post(server, path, **body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(message), error


def test_a_choice_of_many_options_is_one_of_them(server):
    options = [f"option{i}" for i in range(MAX_CHOICES)]
    r = post(server, "chat", guided_choice=options, temperature=1.0, seed=3)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] in options


# ---- a limit hit during generation ----


def test_a_limit_hit_mid_way_ends_the_choice_with_error(server, client):
    before = scrape(server.url).get("pagedllm:sequence_errors_total", 0.0)
    for path in ("chat", "completions"):
        r = post(server, path, guided_grammar=LIMIT_HIT_MID_WAY, max_tokens=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "error"
        assert choice["stop_reason"].startswith(
            "structured output failed during generation: lexer error:"), choice
    # Streamed: the finish chunk says "error", then an error event (the client raises).
    with pytest.raises(openai.APIError, match="structured output failed during generation"):
        for _ in client.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=30, stream=True,
                extra_body={"guided_grammar": LIMIT_HIT_MID_WAY}):
            pass
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "a", "max_tokens": 30, "stream": True,
            "guided_grammar": LIMIT_HIT_MID_WAY}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert events[-2]["choices"][0]["finish_reason"] == "error"
    assert events[-1]["error"]["code"] == "structured_output_failed"
    assert scrape(server.url)["pagedllm:sequence_errors_total"] == before + 4


# ---- tool_choice ----


class GetWeather(BaseModel):
    """The current weather in a city"""

    city: str


def test_a_named_tool_choice_gives_exactly_one_call(client):
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=120,
            temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                            WEATHER_TOOL["function"]["parameters"])
    # openai's parse() with a pydantic tool names it: no LengthFinishReasonError.
    r = client.chat.completions.parse(
        model=MODEL, messages=QUESTION, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, max_tokens=120,
        temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_required_with_parallel_calls_may_end_after_any_call(client):
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=True, max_tokens=200, temperature=0, n=2, seed=4)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls


# ---- sampling parameters at their extremes ----


def test_extreme_sampling_values_act_as_their_limit_or_are_refused(server):
    greedy = post(server, "chat", temperature=0, max_tokens=6).json()
    tiny = post(server, "chat", temperature=1.0, top_p=1e-300, seed=9, max_tokens=6).json()
    assert tiny["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    assert tiny["choices"][0]["message"]["content"]
    tiny_temperature = post(server, "chat", temperature=1e-300, max_tokens=6).json()
    assert tiny_temperature["choices"][0]["message"] == greedy["choices"][0]["message"]
    r = post(server, "chat", min_p=1e-300, temperature=1.0, seed=1)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    for value in (1e-300, 1e300):
        r = post(server, "chat", repetition_penalty=value)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            f"repetition_penalty must be in [1e-30, 1e+30], got {value}")


# ---- vLLM's chat extras ----


def test_continue_final_message_continues_the_prefill(server):
    prefill = [{"role": "user", "content": "Name three colors."},
               {"role": "assistant", "content": "Sure: red, green,"}]
    r = post(server, "chat", messages=prefill, continue_final_message=True,
             add_generation_prompt=False, temperature=0)
    content = r.json()["choices"][0]["message"]["content"]
    assert content.strip(), r.text
    r = post(server, "chat", messages=prefill, continue_final_message=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = post(server, "chat", messages=prefill[:1], continue_final_message=True,
             add_generation_prompt=False)
    assert r.status_code == 400 and "last assistant message" in r.json()["error"]["message"]


def test_prompt_logprobs_on_chat(server):
    r = post(server, "chat", prompt_logprobs=2, max_tokens=2).json()
    prompt = r["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == r["usage"]["prompt_tokens"]
    for step in prompt[1:]:
        assert 1 <= len(step) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in step.values())
    r = post(server, "chat", prompt_logprobs=1, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


# ---- the acceptance property: pathological constraints ----


def _conforms(kind: str, constraint, text: str) -> bool:
    if kind == "guided_choice":
        return text in constraint
    if kind == "guided_regex":
        return re.fullmatch(constraint, text) is not None
    try:
        jsonschema.validate(json.loads(text), constraint)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


_word = st.text("abc", min_size=1, max_size=4)
_repeat = st.sampled_from([1, 3, 50, MAX_REGEX_REPEAT, MAX_REGEX_REPEAT + 1, 10 ** 6])
_regex = st.one_of(
    st.builds(lambda w, n: f"{w}{{{n}}}", _word, _repeat),
    st.builds(lambda w, n: f"({w}|x{{{n}}})+", _word, _repeat),
    st.builds(lambda w, n: f"[a-c]{{{n},}}{w}", _word, _repeat))
_schema = st.recursive(
    st.one_of(st.just({"type": "integer"}), st.just(REF_LOOP),
              st.builds(lambda n: {"type": "string", "maxLength": n}, _repeat),
              st.builds(lambda n: {"type": "string", "pattern": f"^a{{{n}}}$"}, _repeat),
              st.builds(lambda n: {"enum": list(range(n))}, st.sampled_from([1, 5, 10001]))),
    lambda inner: st.one_of(
        st.builds(lambda s: {"type": "array", "items": s, "minItems": 1, "maxItems": 2}, inner),
        st.builds(lambda s: {"type": "object", "properties": {"k": s}, "required": ["k"]},
                  inner),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner)),
    max_leaves=3)
_constraint = st.one_of(
    st.tuples(st.just("guided_choice"),
              st.builds(lambda w, n: [f"{w}{i}" for i in range(n)], _word,
                        st.sampled_from([1, 2, 3000, MAX_CHOICES + 1]))),
    st.tuples(st.just("guided_regex"), _regex),
    st.tuples(st.just("guided_json"), _schema))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(_constraint)
def test_no_pathological_constraint_stops_with_nonconforming_text(server, kind_constraint):
    kind, constraint = kind_constraint
    r = post(server, "completions", max_tokens=24, temperature=1.0, seed=0,
             **{kind: constraint})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] == kind
        return
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "error")
    if choice["finish_reason"] == "stop":
        assert _conforms(kind, constraint, choice["text"]), (constraint, choice)


# ---- --max-model-len ----


def test_max_model_len_over_the_models_is_an_error_unless_allowed():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", None)
    run = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "hi",
                          "--max-tokens", "1", "--max-model-len", "100000"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "error: --max-model-len 100000 is longer than the model's 8192 positions "
        "(max_position_embeddings); set PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway")
    env["PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    run = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "hi",
                          "--max-tokens", "2", "--max-model-len", "10000",
                          "--kv-cache-memory", str(32 << 20)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "context 10000 tokens" in run.stderr
