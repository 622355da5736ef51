"""Structured output and tool calling through the real server, driven by unmodified clients:
the openai client's `parse`, LangChain's `with_structured_output`, a tool round trip
(streamed and not), and 400s for constraints that cannot compile."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.tool_calls import ToolTextFilter, call_grammar, parse_tool_calls
from pagedllm.sampling_params import StructuredOutputsParams
from tests.test_server import serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    """A city and where it is."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=50_000_000)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": WEATHER}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                  "maxLength": 20}},
                       "required": ["city"]}}},
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    yield from serve(["--max-model-len", "2048", "--kv-cache-memory", str(32 << 20)])


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_openai_parse_with_a_pydantic_model(client):
    for parse in (client.chat.completions.parse, client.beta.chat.completions.parse):
        r = parse(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}],
                  response_format=City, max_tokens=80, temperature=0)
        city = r.choices[0].message.parsed
        assert isinstance(city, City) and r.choices[0].finish_reason == "stop"
    # Sampled: every answer still parses.
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Name a city."}],
        response_format=City, max_tokens=80, temperature=1.0, n=4, seed=5)
    assert all(isinstance(c.message.parsed, City) for c in r.choices)


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL,
                     temperature=0, max_tokens=80, max_retries=0)
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Tell me about Paris.")
        assert isinstance(city, City), method


def _check_calls(message, names=("get_weather", "get_time")):
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(args, WEATHER)
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


def _round_trip_messages(message):
    """The history after a call: the assistant's calls, then one tool result each."""
    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in message.tool_calls]
    results = [{"role": "tool", "tool_call_id": c.id, "content": "18 degrees and sunny"}
               for c in message.tool_calls]
    return QUESTION + [{"role": "assistant", "content": None, "tool_calls": calls}] + results


def test_tool_round_trip(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                       tool_choice="required", max_tokens=100, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message)
    final = client.chat.completions.create(
        model=MODEL, messages=_round_trip_messages(choice.message), tools=TOOLS,
        max_tokens=40, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls


def test_tool_round_trip_streamed(client):
    with client.chat.completions.stream(model=MODEL, messages=QUESTION, tools=TOOLS,
                                        tool_choice="required", max_tokens=100,
                                        temperature=0) as stream:
        for _ in stream:
            pass
        done = stream.get_final_completion()
    unstreamed = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                tool_choice="required", max_tokens=100,
                                                temperature=0)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls"
    _check_calls(message)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in unstreamed.choices[0].message.tool_calls]
    chunks = client.chat.completions.create(
        model=MODEL, messages=_round_trip_messages(message), tools=TOOLS, max_tokens=40,
        temperature=0, stream=True)
    text, reason = "", None
    for chunk in chunks:
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    assert reason in ("stop", "length", "tool_calls")


def test_named_tool_choice_and_parallel_tool_calls(client):
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=100, temperature=1.0, n=3,
        seed=1, tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                       tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason != "tool_calls"


def test_response_format_and_vllm_extras(client, server):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat in JSON."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="The year was", max_tokens=6,
                                  temperature=1.0, n=3,
                                  extra_body={"structured_outputs": {"regex": " 1[89][0-9]{2}"}})
    assert all(re.fullmatch(" 1[89][0-9]{2}", c.text) for c in r.choices)
    r = client.completions.create(
        model=MODEL, prompt="A person as JSON:", max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": {"type": "object", "properties": {
                "age": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["age"]}}}})
    assert 1 <= json.loads(r.choices[0].text)["age"] <= 99
    r = client.completions.create(model=MODEL, prompt="Say", max_tokens=6,
                                  extra_body={"guided_grammar": 'start: " hello" | " bye"'})
    assert r.choices[0].text in (" hello", " bye")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "response_format: invalid JSON schema: "),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", 'response_format of type "json_schema" needs json_schema.schema'),
    ({"guided_regex": "(?<=a)b"}, "guided_regex", "guided_regex: invalid regex: "),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs",
     "structured_outputs: invalid regex: "),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar",
     "guided_grammar: invalid grammar: "),
    ({"guided_json": {"type": "integer"}, "guided_regex": "a"}, "guided_regex",
     "give at most one of response_format, structured_outputs, guided_json, guided_regex, "
     "guided_choice, guided_grammar; got guided_json, guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nope"}}}}}], "tool_choice": "required"},
     "tools", "tools: invalid grammar: "),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "tool_choice names the function 'nope', which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
])
def test_bad_constraints_answer_400(server, body, param, message):
    payload = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(message), error["message"]
    assert error["param"] == param
    if "tools" not in body and "tool_choice" not in body:  # completions take the same fields
        payload = {"model": MODEL, "prompt": "x", "max_tokens": 4, **body}
        r = httpx.post(server.url + "/v1/completions", json=payload, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message)


# ---- the tool-call parser and stream filter (no server) ----


def test_parse_tool_calls():
    names = {"get_weather"}
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text, names)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert content.startswith("Let me check.") and "unknown" in content
    assert parse_tool_calls("no calls here", names) == ("no calls here", [])
    # An unclosed last block whose JSON is whole still counts.
    _, calls = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {}}', names)
    assert len(calls) == 1


def test_stream_filter_holds_back_only_what_may_be_a_call():
    f = ToolTextFilter()
    assert f.feed("Hello <tool") == "Hello "
    assert f.feed("box> and") == "<toolbox> and"
    assert f.feed(" then <tool_call>\n{") == " then "
    assert f.feed('"name": 1}') == ""
    assert f.rest() == '<tool_call>\n{"name": 1}'


def test_call_grammar_compiles_for_every_tool_choice():
    functions = [t["function"] for t in TOOLS]
    for parallel in (False, True):
        StructuredOutputsParams(grammar=call_grammar(functions, parallel))
        StructuredOutputsParams(grammar=call_grammar(functions[:1], parallel))
