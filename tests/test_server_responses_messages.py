"""/v1/responses (OpenAI's Responses API) and /v1/messages (Anthropic's Messages API) on a
real `pagedllm serve --api-key`, driven by the unmodified official clients (openai,
anthropic, LangChain's ChatAnthropic) and by raw httpx where the wire format is under test.

Both APIs run on the chat path, so their answers must equal the chat endpoint's for the same
conversation at temperature 0 (same prompt, same tokens)."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.test_server import serve

pytestmark = pytest.mark.slow

KEY = "sk-agent-apis"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CITY = {"type": "object", "properties": {"name": {"type": "string"},
                                         "country": {"type": "string"}},
        "required": ["name", "country"], "additionalProperties": False}
T0 = {"temperature": 0}  # anthropic's client no longer has a temperature argument


@pytest.fixture(scope="module")
def server():
    yield from serve(["--api-key", KEY, "--max-model-len", "1024",
                      "--kv-cache-memory", str(32 << 20)])


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def chat_text(oai, model, messages, **kwargs) -> tuple[str, object]:
    r = oai.chat.completions.create(model=model, messages=messages, temperature=0, **kwargs)
    return r.choices[0].message.content, r.usage


# ---- /v1/responses ----


def test_responses_plain_equals_chat(oai, model):
    r = oai.responses.create(model=model, input="What is the capital of France?",
                             instructions="Answer in one sentence.", max_output_tokens=24,
                             temperature=0)
    text, usage = chat_text(oai, model, [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}], max_tokens=24)
    assert r.object == "response" and r.output_text == text and "Paris" in text
    assert r.status == ("incomplete" if usage.completion_tokens == 24 else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens,
                                                             usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens
    assert oai.responses.retrieve(r.id).output_text == text  # kept in the store


def test_responses_max_output_tokens_is_incomplete(oai, model):
    r = oai.responses.create(model=model, input="Tell me a long story.", max_output_tokens=3,
                             temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_responses_stream_events(oai, model):
    kwargs = dict(model=model, input="What is the capital of France?", max_output_tokens=24,
                  temperature=0)
    whole = oai.responses.create(**kwargs)
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_responses_function_tool_round_trip(oai, model):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
              "parameters": WEATHER}]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    r = oai.responses.create(model=model, input=[question], tools=tools,
                             tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=60, temperature=0)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.status == "completed"
    follow = [question, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 22 C"}]
    r2 = oai.responses.create(model=model, input=follow, tools=tools, max_output_tokens=30,
                              temperature=0)
    # The same conversation through the chat endpoint gives the same answer.
    text, _ = chat_text(oai, model, [
        question,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 22 C"}],
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "description": "The weather of a city",
                                                 "parameters": WEATHER}}], max_tokens=30)
    assert r2.output_text == text
    # previous_response_id continues the stored conversation: the same prompt again.
    r3 = oai.responses.create(model=model, previous_response_id=r.id, tools=tools,
                              input=[follow[2]], max_output_tokens=30, temperature=0)
    assert r3.output_text == text and r3.usage.input_tokens == r2.usage.input_tokens


def test_responses_streamed_function_call(oai, model):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    stream = oai.responses.create(model=model, input="Weather in Rome?", tools=tools,
                                  tool_choice={"type": "function", "name": "get_weather"},
                                  parallel_tool_calls=False, max_output_tokens=60,
                                  temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Rome"}
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [i.type for i in final.output] == ["function_call"]


def test_responses_json_schema(oai, model):
    r = oai.responses.create(
        model=model, input="Name a city and its country.", max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema"


def oai_error(server, body, headers=None) -> tuple[int, dict]:
    r = httpx.post(server.url + "/v1/responses", json=body,
                   headers={"Authorization": f"Bearer {KEY}"} if headers is None else headers,
                   timeout=60)
    return r.status_code, r.json()


@pytest.mark.parametrize("body,message,param", [
    ({"input": 3}, "invalid value for input: Input should be a valid string", "input"),
    ({"input": [{"type": "image_generation_call"}]},
     "invalid value for input.0.type: Input tag 'image_generation_call' found using type() "
     "does not match any of the expected tags: 'message', 'function_call', "
     "'function_call_output', 'reasoning'", "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "invalid value for input.0.content.0.text: Input should be a valid string",
     "input.0.content.0.text"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]},
     "input.0: no function_call with call_id 'call_1' precedes this function_call_output",
     "input.0.call_id"),
    ({"input": "hi", "max_output_tokens": 5000}, None, None),
    ({"input": "hi " * 1100}, None, None),
    ({"input": "hi", "previous_response_id": "resp_gone"},
     "Previous response with id 'resp_gone' not found (this server keeps the last 256 "
     "stored responses in memory).", "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]},
     "invalid value for tools.0.type: Input should be 'function'", "tools.0.type"),
], ids=["wrong-type", "unknown-item", "wrong-part-type", "orphan-output", "max-tokens",
        "long-prompt", "unknown-previous", "other-tool"])
def test_responses_bad_input(server, body, message, param):
    status, error = oai_error(server, body)
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
    if message is not None:
        assert error["error"]["message"] == message and error["error"]["param"] == param
    else:
        assert "1024 tokens" in error["error"]["message"]


def test_responses_need_the_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY}):
        status, error = oai_error(server, {"input": "hi"}, headers)
        assert status == 401 and error["error"]["code"] == "invalid_api_key"


# ---- /v1/messages ----


def test_messages_create_equals_chat(claude, oai, model):
    m = claude.messages.create(model=model, max_tokens=24, system="Answer in one sentence.",
                               messages=[{"role": "user", "content": "What is the capital of "
                                                                     "France?"}], extra_body=T0)
    text, usage = chat_text(oai, model, [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}], max_tokens=24)
    assert m.type == "message" and m.role == "assistant" and m.model == model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert m.stop_reason == ("max_tokens" if usage.completion_tokens == 24 else "end_turn")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (usage.prompt_tokens,
                                                             usage.completion_tokens)
    count = claude.messages.count_tokens(model=model, system="Answer in one sentence.",
                                         messages=[{"role": "user", "content": "What is the "
                                                    "capital of France?"}])
    assert count.input_tokens == usage.prompt_tokens


def test_messages_system_blocks_and_stop_sequences(claude, oai, model):
    system = [{"type": "text", "text": "Answer in one sentence."}]
    m = claude.messages.create(model=model, max_tokens=24, system=system, stop_sequences=[
        " is"], messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is the capital of France?"}]}], extra_body=T0)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " is"
    text, _ = chat_text(oai, model, [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
        stop=[" is"])
    assert m.content[0].text == text


def test_messages_stream(claude, model):
    kwargs = dict(model=model, max_tokens=24, extra_body=T0,
                  messages=[{"role": "user", "content": "What is the capital of France?"}])
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    texts = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(texts) > 1 and "".join(texts) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == \
        whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_messages_raw_stream_events(server, model):
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY}, json={
            "model": model, "max_tokens": 5, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a story."}]}) as r:
        body = "".join(r.iter_text())
    events = [block.split("\n", 1) for block in body.strip().split("\n\n")]
    names = [e[0].removeprefix("event: ") for e in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    data = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert all(d["type"] == n for d, n in zip(data, names))
    assert data[-2]["delta"]["stop_reason"] == "max_tokens"
    assert data[-2]["usage"]["output_tokens"] == 5


def test_messages_tool_use_round_trip(claude, oai, model):
    tools = [{"name": "get_weather", "description": "The weather of a city",
              "input_schema": WEATHER}]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    m = claude.messages.create(model=model, max_tokens=60, tools=tools, messages=[question],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               extra_body=T0)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    answer = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "sunny, 22 C"}]}
    m2 = claude.messages.create(model=model, max_tokens=30, tools=tools, extra_body=T0,
                                messages=[question, {"role": "assistant", "content": m.content},
                                          answer])
    text, usage = chat_text(oai, model, [
        question,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": use.id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 22 C"}],
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "description": "The weather of a city",
                                                 "parameters": WEATHER}}], max_tokens=30)
    assert m2.content[0].text == text and m2.usage.input_tokens == usage.prompt_tokens
    # Streamed, with a named tool: the input arrives as input_json_delta.
    with claude.messages.stream(model=model, max_tokens=60, tools=tools, messages=[question],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True},
                                extra_body=T0) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_messages_output_config_json_schema(claude, model):
    m = claude.messages.create(model=model, max_tokens=60, extra_body=T0,
                               output_config={"format": {"type": "json_schema", "schema": CITY}},
                               messages=[{"role": "user", "content": "Name a city."}])
    jsonschema.validate(json.loads(m.content[0].text), CITY)


def test_langchain_chat_anthropic(server, model):
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool

    llm = ChatAnthropic(model=model, base_url=server.url, api_key=KEY, max_tokens=24,
                        temperature=0, max_retries=0)
    reply = llm.invoke("What is the capital of France?")
    assert "Paris" in reply.content and reply.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.content if isinstance(chunk.content, str) else "".join(
        part.get("text", "") for part in chunk.content)
        for chunk in llm.stream("What is the capital of France?"))
    assert streamed == reply.content

    @tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    bound = llm.model_copy(update={"max_tokens": 60}).bind_tools(
        [get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    (call,) = bound.invoke("What is the weather in Paris?").tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}


def anthropic_post(server, path, body, headers=None) -> tuple[int, dict]:
    r = httpx.post(server.url + path, json=body,
                   headers={"x-api-key": KEY} if headers is None else headers, timeout=60)
    return r.status_code, r.json()


def msg(model, content, **extra) -> dict:
    return {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": content}],
            **extra}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("case,message", [
    ("wrong-type", "invalid value for messages.0.content.0.text: Input should be a valid string"),
    ("unknown-block", "invalid value for messages.0.content.0.type: Input tag 'image' found "
                      "using 'type' does not match any of the expected tags: 'text', "
                      "'tool_use', 'tool_result'"),
    ("orphan-result", "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` "
                      "blocks: toolu_1. Each `tool_result` block must have a corresponding "
                      "`tool_use` block in the previous message."),
    ("long-prompt", None),
])
def test_messages_bad_input(server, model, path, case, message):
    content = {"wrong-type": [{"type": "text", "text": 3}],
               "unknown-block": [{"type": "image", "source": {}}],
               "orphan-result": [{"type": "tool_result", "tool_use_id": "toolu_1"}],
               "long-prompt": "hi " * 1100}[case]
    status, error = anthropic_post(server, path, msg(model, content))
    assert status == 400 and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    if message is None:
        assert "1024 tokens" in error["error"]["message"]
    else:
        assert error["error"]["message"] == message


def test_messages_refusals(server, model):
    status, error = anthropic_post(server, "/v1/messages", {**msg(model, "hi"),
                                                            "max_tokens": 5000})
    assert status == 400 and "context of 1024 tokens" in error["error"]["message"]
    prefill = msg(model, "hi")
    prefill["messages"].append({"role": "assistant", "content": "{"})
    status, error = anthropic_post(server, "/v1/messages", prefill)
    assert status == 400 and error["error"]["message"] == (
        "messages.1: a final assistant message (a prefill) is not supported; end the "
        "conversation with a user message")
    status, error = anthropic_post(server, "/v1/messages", {**msg(model, "hi"), "tools": [
        {"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}})
    assert status == 400 and error["error"]["message"] == 'tool_choice of type "tool" needs a name'
    status, error = anthropic_post(server, "/v1/messages", msg("claude-nope", "hi"))
    assert (status, error["error"]["type"]) == (404, "not_found_error")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_need_the_key(server, model, path):
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        status, error = anthropic_post(server, path, msg(model, "hi"), headers)
        assert status == 401 and error == {"type": "error", "error": {
            "type": "authentication_error", "message": "invalid x-api-key"}}
    status, _ = anthropic_post(server, path, msg(model, "hi"), {"Authorization": f"Bearer {KEY}"})
    assert status == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            **msg(model, "hi"))


def test_response_store_keeps_the_last_ones():
    from pagedllm.entrypoints.openai.protocol_responses import ResponseObject
    from pagedllm.entrypoints.openai.serving_responses import ResponseStore, StoredResponse

    store = ResponseStore(size=3)
    for i in range(5):
        store.put(StoredResponse(ResponseObject(id=f"resp_{i}", status="completed",
                                                model="m"), []))
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True,
                                                                       True, True]


def test_retrieve_an_unknown_response(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.responses.retrieve("resp_unknown")
    assert info.value.status_code == 404 and info.value.code == "response_not_found"


def test_messages_errors_in_anthropic_shape_are_documented(server):
    body = json.dumps({"model": "x", "pad": "x" * (9 << 20)})  # over --max-request-bytes
    resp = httpx.post(server.url + "/v1/messages", content=body, timeout=60,
                      headers={"x-api-key": KEY, "Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for path, ref in (("/v1/messages", "AnthropicErrorResponse"),
                      ("/v1/messages/count_tokens", "AnthropicErrorResponse"),
                      ("/v1/responses", "ErrorResponse")):
        responses = paths[path]["post"]["responses"]
        assert "422" not in responses
        for code in ("400", "401", "404", "413"):
            assert responses[code]["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{ref}"}
