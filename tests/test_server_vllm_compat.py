"""A real `pagedllm serve MODEL` started with vLLM's flags: two served names, the small routes,
and reasoning output through a chat template that opens <think> (as Qwen3's and R1's do)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagedllm.loader import default_model_path
from tests.test_server import serve

pytestmark = pytest.mark.slow

KEY = "sk-vllm-compat"
# SmolLM2's turns, with Qwen3's generation prompt: <think> opened, or closed at once when
# the request says enable_thinking false.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and enable_thinking is "
    "false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 120}},
    "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    yield from serve([
        default_model_path(), "--served-model-name", "alpha", "beta", "--api-key", KEY,
        "--reasoning-parser", "qwen3", "--chat-template", str(template),
        "--dtype", "float", "-tp", "1", "--max-model-len", "2k", "--kv-cache-memory", "200000000",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--generation-config", "vllm", "--uvicorn-log-level", "warning",
        "--enable-log-requests", "--trust-remote-code"])


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_served_under_every_name(client, server):
    assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
    assert client.models.retrieve("beta").id == "beta"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gamma")
    assert info.value.body == {"message": "The model `gamma` does not exist.",
                               "type": "invalid_request_error", "param": "model",
                               "code": "model_not_found"}
    for name in ("alpha", "beta"):
        out = client.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert out.model == "alpha" and out.usage.completion_tokens == 2  # as vLLM: the first
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt="Hello", max_tokens=2)
    assert "Received request cmpl-" in server.read_stderr()  # --enable-log-requests


def test_small_routes(server):
    assert httpx.get(server.url + "/version").json() == {"version": "0.1.0"}
    for method in ("GET", "POST"):
        assert httpx.request(method, server.url + "/ping").json() == {"status": "ok"}
    assert httpx.get(server.url + "/tokenizer_info").status_code == 401
    assert httpx.get(server.url + "/v1/models/alpha").status_code == 401
    info = httpx.get(server.url + "/tokenizer_info", headers=auth()).json()
    assert info["eos_token"] == "<|im_end|>" and info["vocab_size"] == 49152
    assert info["model_max_length"] == 2000 and info["chat_template"] == THINKING_TEMPLATE
    assert info["added_tokens_decoder"]["2"] == {"content": "<|im_end|>", "special": True}


def bounded(n: int) -> dict:
    """Thinking of at most n tokens (then </think> is forced): the small model never
    closes it by itself."""
    return {"thinking_token_budget": n}


def test_reasoning_split_exactly_streamed_and_not(client, server):
    kwargs = dict(model="beta", messages=QUESTION, max_tokens=40, temperature=0,
                  extra_body=bounded(12))
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning, content = message.reasoning_content, message.content
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    stream = client.chat.completions.create(stream=True, **kwargs)
    parts = {"reasoning_content": [], "content": []}
    for chunk in stream:
        delta = chunk.choices[0].delta
        for key in parts:
            if getattr(delta, key, None):
                parts[key].append(getattr(delta, key))
    assert "".join(parts["reasoning_content"]) == reasoning
    assert "".join(parts["content"]) == (content or "")
    # The same prompt, raw: the model's text is exactly reasoning + </think> + content.
    ids = httpx.post(server.url + "/tokenize", headers=auth(), json={
        "model": "alpha", "messages": QUESTION}).json()["tokens"]
    lark = ('start: thinking "</think>" TEXT\nTEXT: /(?s:.*)/\n'
            'thinking[stop="</think>", max_tokens=15]: /(?s:.*)/\n')  # 12 + </think>'s 3
    raw = client.completions.create(model="alpha", prompt=ids, max_tokens=40, temperature=0,
                                    extra_body={"guided_grammar": lark}).choices[0].text
    assert raw == reasoning + "</think>" + (content or "")


def test_json_schema_after_thinking_is_always_valid(client):
    response = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "Describe a person."}], n=50,
        max_tokens=50, temperature=1.0, seed=3, extra_body=bounded(10),
        response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                "schema": PERSON}})
    thought = 0
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        thought += bool(choice.message.reasoning_content)
    assert thought == 50  # every answer came after a thinking section


def test_enable_thinking_false_gives_no_reasoning(client):
    message = client.chat.completions.create(
        model="alpha", messages=QUESTION, max_tokens=12, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content
    message = client.chat.completions.create(
        model="alpha", messages=QUESTION, max_tokens=5, temperature=0).choices[0].message
    assert message.content is None and message.reasoning_content  # cut short while thinking


def test_thinking_budget_and_template_kwargs_errors(client):
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.chat.completions.create(model="alpha", messages=QUESTION, max_tokens=2,
                                       extra_body={"thinking_token_budget": -1})
    with pytest.raises(openai.BadRequestError,
                       match="chat_template_kwargs cannot set add_generation_prompt"):
        client.chat.completions.create(
            model="alpha", messages=QUESTION, max_tokens=2,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_tool_call_after_thinking(client):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 20}}}}}]
    kwargs = dict(model="alpha", messages=[{"role": "user", "content": "The weather in Paris?"}],
                  tools=tools, tool_choice="required", max_tokens=60, temperature=0,
                  extra_body=bounded(8))
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # Streamed: the thinking as reasoning deltas, then the call, no text content.
    reasoning, calls, content, reasons = [], [], [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(reasoning) == choice.message.reasoning_content and not "".join(content)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (call.function.name, call.function.arguments)]
    assert reasons[-1] == "tool_calls"
