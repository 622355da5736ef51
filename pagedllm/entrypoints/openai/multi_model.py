"""Several base models behind one server (`pagedllm serve --model a --model b`): one app per
engine, as a single-model server builds it, and in front of them a dispatcher that sends each
request to the app of the model its body names.

- A POST whose JSON body has a `model` goes to that model's app; a name no engine serves is a
  404 naming the served ones (after the key check: a caller without the key learns 401).
- POST /v1/load_lora_adapter and /v1/unload_lora_adapter go to the app of the body's
  `base_model` (unload without one: the app holding the adapter), refused when a load names
  no base or takes a name the server already serves (openai/lora_routes.py).
- Everything else (no body, no `model`: the web UI, /tokenizer_info, /v1/engine/state) goes
  to the first model's app, as vLLM sends a request without a model to its first name.
- GET /v1/models lists every app's models (GET /v1/models/{id}: the app serving it);
  GET /metrics joins every app's series (each
  labelled with its own `model_name`) into one exposition.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AsyncExitStack

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from pagedllm.entrypoints.openai import lora_routes
from pagedllm.entrypoints.openai.error_shape import error_body
from pagedllm.entrypoints.openai.serving_engine import OpenAIError

Names = Callable[[], list[str]]  # the names an app answers to, read at each request


class MultiModelApp:
    def __init__(self, apps: list[tuple[FastAPI, Names]], max_request_bytes: int,
                 key_refusal: Callable) -> None:
        self.apps = apps
        self.default = apps[0][0]
        self.max_request_bytes = max_request_bytes
        self.key_refusal = key_refusal  # the first app's: every app has the same key
        # One load at a time: a name checked free on every base stays free until it is added.
        self.lora_lock = asyncio.Lock()

    def app_for(self, model: str) -> FastAPI | None:
        for app, names in self.apps:
            if model in names():
                return app
        return None

    def served_names(self) -> list[str]:
        return [name for _, names in self.apps for name in names()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        if scope["type"] != "http":
            await self.default(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if method in ("GET", "HEAD") and path in ("/v1/models", "/metrics"):
            await self.gathered(scope, receive, send)
            return
        if method in ("GET", "HEAD") and path.startswith("/v1/models/"):  # its card
            app = self.app_for(path.removeprefix("/v1/models/")) or self.default
            await app(scope, receive, send)
            return
        if method != "POST":
            await self.default(scope, receive, send)
            return
        messages, body = await self.read_body(receive)
        replay = _replay(messages, receive)
        if path in (lora_routes.LOAD, lora_routes.UNLOAD):
            await self.lora_route(scope, replay, send, body)
            return
        model = _model_of(body)
        if model is None:
            await self.default(scope, replay, send)
            return
        app = self.app_for(model)
        if app is None:
            response = await self.key_refusal(scope) or self.unknown_model(path, model)
            await response(scope, replay, send)
            return
        await app(scope, replay, send)

    async def lora_route(self, scope: Scope, receive: Receive, send: Send,
                         body: bytes | None) -> None:
        """A load or unload to the app of its base model, or its refusal (after the key)."""
        engines = [app.state.engine for app, _ in self.apps]
        bases = [(lora_routes.base_names(e), lora_routes.adapter_names(e)) for e in engines]
        target = lora_routes.pick_base(scope["path"], _json_of(body), bases)
        if isinstance(target, OpenAIError):
            response = await self.key_refusal(scope) or JSONResponse(
                error_body(scope["path"], target.status_code, target.message, param=target.param,
                           code=target.code), status_code=target.status_code)
            await response(scope, receive, send)
            return
        async with self.lora_lock:
            await self.apps[target][0](scope, receive, send)

    def unknown_model(self, path: str, model: str) -> Response:
        served = ", ".join(self.served_names())
        message = f"The model `{model}` does not exist; this server serves: {served}"
        return JSONResponse(error_body(path, 404, message, param="model",
                                       code="model_not_found"), status_code=404)

    async def read_body(self, receive: Receive) -> tuple[list[Message], bytes | None]:
        """The request's messages as read, and its body when whole and within the limit
        (else None: the app's own body limit answers it)."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages, None
            size += len(message.get("body", b""))
            if size > self.max_request_bytes:
                return messages, None
            if not message.get("more_body", False):
                return messages, b"".join(m.get("body", b"") for m in messages)

    async def gathered(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/v1/models or /metrics of every app in one answer; the first app's when it is
        not a 200 (a missing key)."""
        answers = [await _call(app, scope) for app, _ in self.apps]
        status, headers, first = answers[0]
        if status != 200:
            await _send(send, status, headers, first)
            return
        bodies = [body for _, _, body in answers]
        if scope["path"] == "/v1/models":
            data = [card for body in bodies for card in json.loads(body)["data"]]
            merged = json.dumps({"object": "list", "data": data}).encode()
        else:
            merged = join_expositions([body.decode() for body in bodies]).encode()
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        await _send(send, 200, headers, merged if scope["method"] == "GET" else b"",
                    len(merged))

    async def lifespan(self, receive: Receive, send: Send) -> None:
        """Every app's lifespan (each shuts its engine down at the end)."""
        await receive()  # lifespan.startup
        async with AsyncExitStack() as stack:
            for app, _ in self.apps:
                await stack.enter_async_context(app.router.lifespan_context(app))
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})


def join_expositions(texts: list[str]) -> str:
    """Prometheus text expositions with the same families, one family's samples together
    under one HELP and TYPE (a family may appear only once in an exposition)."""
    families: dict[str, list[str]] = {}
    order: list[str] = []
    for text in texts:
        name = ""
        for line in text.splitlines():
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
                if name not in families:
                    families[name] = [line]
                    order.append(name)
                continue
            if line.startswith("# TYPE "):
                if len(families[name]) == 1:
                    families[name].append(line)
                continue
            if line:
                families.setdefault(name, []).append(line)
    return "".join(line + "\n" for name in order for line in families[name])


def _json_of(body: bytes | None) -> object:
    if not body:
        return None
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # the app's own 400 names the problem


def _model_of(body: bytes | None) -> str | None:
    parsed = _json_of(body)
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


async def _call(app: FastAPI, scope: Scope) -> tuple[int, list, bytes]:
    """A bodiless request to `app`, its answer collected."""
    status, headers, chunks = 500, [], []
    done = asyncio.Event()

    async def receive() -> Message:
        if not done.is_set():
            done.set()
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the answer is collected whole
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app({**scope, "method": "GET"}, receive, send)
    return status, headers, b"".join(chunks)


async def _send(send: Send, status: int, headers: list, body: bytes,
                length: int | None = None) -> None:
    if length is not None:
        headers = [*headers, (b"content-length", str(length).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
