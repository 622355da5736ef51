"""The FastAPI app: OpenAI routes, tokenizer routes, health, metrics, API-key check.

Its OpenAPI schema (GET /openapi.json) tells the truth: validation errors are 400 in OpenAI's
error shape (FastAPI's 422 is not used), and 401, 404 and 413 are documented where they occur.
The Anthropic routes (/v1/messages) answer in Anthropic's error shape instead.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.entrypoints.openai.auth import key_check, key_error
from pagedllm.entrypoints.openai.error_shape import error_body
from pagedllm.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BYTES, RequestBodyLimit
from pagedllm.entrypoints.openai.http_protocol import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_COUNT,
    http_protocol,
)
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.multi_model import MultiModelApp
from pagedllm.entrypoints.openai.protocol import (
    MESSAGE_ROLES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai import lora_routes, vllm_routes
from pagedllm.entrypoints.openai.protocol_anthropic import MESSAGES_UNION_TAGS
from pagedllm.entrypoints.openai.protocol_responses import RESPONSES_UNION_TAGS
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, embedding_router
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, PromptTokenizer, SSEResponse
from pagedllm.entrypoints.openai.serving_messages import messages_router
from pagedllm.entrypoints.openai.serving_responses import add_responses_routes
from pagedllm.entrypoints.web.router import build_web_router

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """What `pagedllm serve` adds to the engine's options."""

    api_key: str | None = None  # required on every route that touches the model
    metrics_need_key: bool = False  # /metrics behind the key too
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_tokens_default: int | None = None  # max_tokens of requests that set none
    log_requests: bool = False  # one log line per request (--enable-log-requests)
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: <think> text apart
    # Sampling values of requests that leave them unset (--generation-config).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # CORS, off unless origins are given (vLLM's --allowed-origins and friends).
    allowed_origins: list[str] | None = None
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    docs: bool = False  # /docs and /redoc (their pages load their assets from a CDN)
    openapi: bool = True  # /openapi.json
    # The connection's limits (seconds; uvicorn's and h11's where they have them).
    timeout_keep_alive: float = 5.0
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    h11_max_incomplete_event_size: int = 16 << 10
    h11_max_header_count: int = DEFAULT_MAX_HEADER_COUNT


_ERRORS = {
    400: "Invalid request: the message names the problem (also for schema violations)",
    401: "Missing or wrong API key (`Authorization: Bearer KEY`)",
    404: "Unknown model (code `model_not_found`)",
    413: "Request body over the server's --max-request-bytes",
}


# One server-sent event (OpenAPI 3.1: the schema of an event stream describes each event).
_SSE_EVENT = {
    "type": "object",
    "description": "`data`: one chunk as JSON (a response's shape; chat: object "
                   "`chat.completion.chunk`), an `error` object, or `[DONE]` at the end",
    "properties": {"data": {"type": "string"}},
    "required": ["data"],
}


def _documented(*codes: int, ok: type | None = None, stream: bool = False) -> dict:
    """The `responses` of a route: its 200 (JSON, or SSE too) and its errors."""
    responses: dict[int | str, dict] = {
        code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in codes
    }
    if ok is not None:
        responses[200] = {"model": ok, "description": "Successful Response"}
        if stream:
            responses[200]["description"] = "JSON, or server-sent events with `stream: true`"
            responses[200]["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    return responses


def build_app(engine: AsyncLLMEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = ServerMetrics(engine.model_name, engine.max_model_len,
                            lora_routes.lora_enabled(engine))
    engine.observers.append(metrics)
    tokenizer = PromptTokenizer(engine.tokenizer, engine.max_model_len)
    completion = OpenAIServingCompletion(engine, tokenizer, config.max_tokens_default)
    chat = OpenAIServingChat(engine, tokenizer, config.max_tokens_default)
    for serving in (completion, chat):
        serving.configure(config.log_requests, config.sampling_defaults)
        serving.reasoning_parser = config.reasoning_parser

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        tokenizer.shutdown()
        await engine.shutdown()

    app = FastAPI(title="pagedllm", lifespan=lifespan,
                  docs_url="/docs" if config.docs else None,
                  redoc_url="/redoc" if config.docs else None,
                  openapi_url="/openapi.json" if config.openapi else None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.add_middleware(RequestBodyLimit, max_bytes=config.max_request_bytes,
                       check_head=_key_refusal(app))
    app.add_middleware(HeadAsGet)
    if config.allowed_origins:  # outermost: a preflight is answered before any check
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_methods=config.allowed_methods,
                           allow_headers=config.allowed_headers,
                           allow_credentials=config.allow_credentials)
    _install_error_handlers(app)
    api_key = config.api_key.encode() if config.api_key is not None else None
    key = (401,) if api_key is not None else ()

    @key_check
    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Starlette decodes headers as latin-1: encoding back gives the bytes that were sent.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("latin-1"), api_key):
            raise OpenAIError("Incorrect API key provided.", 401, code="invalid_api_key")

    keyed = APIRouter(dependencies=[Depends(check_api_key)])

    @keyed.get("/v1/models", responses=_documented(*key))
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=engine.max_model_len)
                               for name in vllm_routes.served_names(engine)]
                         + lora_routes.model_cards(engine))

    @keyed.post("/v1/completions", response_model=None,
                responses=_documented(400, *key, 404, 413, ok=CompletionResponse, stream=True))
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        result = await _cancel_on_disconnect(raw, completion.create_completion(body))
        return _respond(result)

    @keyed.post("/v1/chat/completions", response_model=None,
                responses=_documented(400, *key, 404, 413, ok=ChatCompletionResponse,
                                      stream=True))
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        result = await _cancel_on_disconnect(raw, chat.create_chat_completion(body))
        return _respond(result)

    @keyed.post("/tokenize", responses=_documented(400, *key, 404, 413))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        completion.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            tokens = await chat.render_prompt(body.messages, body.add_generation_prompt)
        else:
            tokens = await tokenizer.encode(body.prompt, body.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens),
                                max_model_len=engine.max_model_len)

    @keyed.post("/detokenize", responses=_documented(400, *key, 404, 413))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        completion.check_model(body.model)
        vocab_size = engine.vocab_size
        bad = [t for t in body.tokens if t >= vocab_size]
        if bad:
            raise OpenAIError(
                f"token id {bad[0]} is out of range for a vocabulary of {vocab_size}",
                param="tokens",
            )
        return DetokenizeResponse(prompt=await tokenizer.decode(body.tokens))

    add_responses_routes(keyed, chat, _respond, _cancel_on_disconnect,
                         _documented(400, *key, 404, 413))
    app.include_router(keyed)
    app.include_router(lora_routes.build_router(engine, check_api_key))
    app.include_router(vllm_routes.build_router(engine, check_api_key, api_key is not None))
    app.include_router(messages_router(chat, api_key, _respond, _cancel_on_disconnect,
                                       _validation_to_openai))
    app.include_router(embedding_router(OpenAIServingEmbedding(engine, tokenizer),
                                        [Depends(check_api_key)],
                                        _documented(400, *key, 404, 413), _cancel_on_disconnect))
    app.include_router(build_web_router(engine, check_api_key))

    @app.get("/health")
    async def health() -> HealthResponse:
        # The socket listens only once the model is loaded: no "loading" state to report.
        return HealthResponse()

    metrics_deps = [Depends(check_api_key)] if config.metrics_need_key else []

    @app.get("/metrics", dependencies=metrics_deps, response_class=PlainTextResponse,
             responses=_documented(*(key if config.metrics_need_key else ())))
    async def get_metrics() -> Response:
        stats = await engine.get_stats()
        return Response(metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _key_refusal(app: FastAPI) -> Callable[[Scope], Awaitable[Response | None]]:
    """The 401 of the route a request's head matches, when its key check fails: what a body
    too large to read is answered in place of its 413 (the key comes before the body)."""
    async def check(scope: Scope) -> Response | None:
        for route in _api_routes(app.router.routes):
            match, child = route.matches(scope)
            if match is Match.FULL:
                error = await key_error(Request({**scope, **child}))
                return None if error is None else _error_response(error, scope["path"])
        return None

    return check


def _api_routes(routes: list) -> Any:
    """The app's APIRoutes, also inside included routers (FastAPI from 0.16x keeps an
    included router whole, in its `original_router`; no router here has a prefix)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _api_routes(inner.routes)
        elif hasattr(route, "dependant"):
            yield route


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema less its 422 responses: validation errors answer 400 here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _respond(result: Any) -> Any:
    if isinstance(result, Response):
        return result
    if isinstance(result, SSEResponse):
        return StreamingResponse(result.events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(result.abort))
    return JSONResponse(result.model_dump(mode="json"))


async def _cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run a handler, cancelling it (so its requests abort) if the client leaves first.

    Once a streaming response has started, Starlette cancels its body on disconnect itself.
    An unexpected exception becomes a 500 for this request alone.
    """
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its cleanup aborts the engine requests
    if not task.done():  # nobody is listening; 499 is nginx's "client closed request"
        return Response(status_code=499)
    try:
        return task.result()
    except OpenAIError:
        raise
    except EngineDeadError as exc:
        if not exc.fatal:
            raise OpenAIError(f"internal error: {exc}", 500,
                              type="internal_server_error") from None
        # The engine is gone (a tensor-parallel rank died; logged once); the server stops.
        raise OpenAIError(str(exc), 503, type="internal_server_error") from None
    except Exception as exc:  # this request fails; the server and the engine loop go on
        logger.exception("request failed")
        raise OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500,
                          type="internal_server_error") from None


def _error_response(error: OpenAIError, path: str = "") -> JSONResponse:
    """The error in the shape of the API `path` belongs to (Anthropic's on /v1/messages)."""
    body = error_body(path, error.status_code, error.message, error.type, error.code,
                      error.param)
    return JSONResponse(body, status_code=error.status_code)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(await key_error(request) or _validation_to_openai(exc),
                               request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # a body FastAPI could not read: the key comes first
            unauthorized = await key_error(request)
            if unauthorized is not None:
                return _error_response(unauthorized, request.url.path)
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        response = _error_response(OpenAIError(str(exc.detail), exc.status_code, type=kind),
                                   request.url.path)
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return _error_response(OpenAIError(
            f"internal error: {type(exc).__name__}: {exc}", 500, type="internal_server_error"
        ), request.url.path)


def _validation_to_openai(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's first complaint, as OpenAI words a 400: the message names the field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request")
    # A union reports one error per branch: the branch that got deepest explains best.
    field = errors[0].get("loc", ())[:2]
    first = max((e for e in errors if e.get("loc", ())[:2] == field),
                key=lambda e: len(e.get("loc", ())))
    kind = first.get("type")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return OpenAIError(f"malformed JSON body: {detail}")
    if kind == "lone_surrogate":
        where = first["ctx"]["where"]
        return OpenAIError(first["msg"], param=None if where == "body" else where)
    path = _field_path(first.get("loc", ()))
    if kind == "union_tag_not_found":  # a message without a role, an item without a type
        path = f"{path}.{_tag_field(first)}"
        return OpenAIError(f"missing required field: {path}", param=path)
    if kind == "union_tag_invalid":  # a message with an unknown role, an unknown item type
        path = f"{path}.{_tag_field(first)}"
        return OpenAIError(f"invalid value for {path}: {first['msg']}", param=path)
    if not path:
        return OpenAIError(f"invalid request body: {first['msg']}")
    if kind == "missing":
        return OpenAIError(f"missing required field: {path}", param=path)
    return OpenAIError(f"invalid value for {path}: {first['msg']}", param=path)


def _tag_field(error: dict) -> str:
    """The field a tagged union is told apart by: pydantic quotes it (`'role'`), or names
    the callable that reads it (`type()`)."""
    return error.get("ctx", {}).get("discriminator", "'role'").strip("'").removesuffix("()")


# The tags pydantic puts after a list index in an error's loc (a tag is never the last part).
_UNION_TAGS = frozenset((*MESSAGE_ROLES, *RESPONSES_UNION_TAGS, *MESSAGES_UNION_TAGS))


def _field_path(loc: tuple) -> str:
    """The dotted path of the field, without what pydantic adds for unions: branch types
    (`list[int]`, `TokenizeChatRequest`) and the tag after an index (a message's role, an
    item's type)."""
    parts: list[str] = []
    previous: Any = None
    for k, part in enumerate(loc):
        tag = isinstance(part, str) and (
            "[" in part or "-" in part or part in ("str", "int", "float", "bool", "list", "dict")
            or part[:1].isupper() or (isinstance(previous, int) and part in _UNION_TAGS
                                      and k < len(loc) - 1)
        )
        if part != "body" and not tag:
            parts.append(str(part))
        previous = part
    return ".".join(parts)


class HeadAsGet:
    """HEAD wherever GET is routed: the app serves a GET and the server (which still sees
    HEAD) sends its headers without the body. FastAPI's routes answer HEAD with 405."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a taken port fails fast (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def build_multi_app(engines: list[tuple[AsyncLLMEngine, ServerConfig]]) -> ASGIApp:
    """One app per engine behind a dispatcher by the request's `model` (multi_model.py)."""
    apps = [build_app(engine, config) for engine, config in engines]
    names = [functools.partial(vllm_routes.served_and_adapter_names, engine) for engine, _ in engines]
    return MultiModelApp(list(zip(apps, names)), engines[0][1].max_request_bytes,
                         _key_refusal(apps[0]))


async def serve(
    engine: AsyncLLMEngine,
    sock: socket.socket,
    config: ServerConfig | None = None,
    on_ready: Callable[[str], None] | None = None,
    log_level: str = "warning",
    others: list[tuple[AsyncLLMEngine, ServerConfig]] | None = None,
) -> None:
    """Serve the app on an already bound socket until interrupted; `others`: more models,
    each its own engine (the connection's settings are `config`'s)."""
    import uvicorn

    config = config or ServerConfig()
    app = (build_multi_app([(engine, config), *others]) if others
           else build_app(engine, config))
    uvicorn_config = uvicorn.Config(
        app, log_level=log_level, timeout_graceful_shutdown=5,
        http=http_protocol(config.header_timeout, config.max_connections,
                           config.h11_max_header_count),
        timeout_keep_alive=config.timeout_keep_alive,
        h11_max_incomplete_event_size=config.h11_max_incomplete_event_size)
    server = uvicorn.Server(uvicorn_config)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        if on_ready is not None:
            on_ready(url)

    # An engine that cannot go on (a tensor-parallel rank died) stops the server once the
    # requests in flight have their error; the command then exits non-zero.
    for each in [engine, *(e for e, _ in others or [])]:
        each.on_fatal = lambda exc: setattr(server, "should_exit", True)
    announcer = asyncio.ensure_future(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()
