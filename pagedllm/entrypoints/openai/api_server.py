"""The FastAPI app: OpenAI routes, tokenizer routes, health, metrics, API-key check."""
from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, SSEResponse

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLMEngine, api_key: str | None = None) -> FastAPI:
    metrics = ServerMetrics()
    engine.observers.append(metrics)
    completion = OpenAIServingCompletion(engine)
    chat = OpenAIServingChat(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    _install_error_handlers(app)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
            raise OpenAIError("Incorrect API key provided.", 401, code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, max_model_len=engine.max_model_len)])

    @v1.post("/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        result = await _cancel_on_disconnect(raw, completion.create_completion(body))
        return _respond(result)

    @v1.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        result = await _cancel_on_disconnect(raw, chat.create_chat_completion(body))
        return _respond(result)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        stats = await engine.get_stats()
        return Response(metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        completion.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", param="prompt")
        if engine.tokenizer is None:
            raise OpenAIError("this model has no tokenizer")
        if body.messages is not None:
            tokens = await chat.render_prompt(body.messages, body.add_generation_prompt)
        else:
            text, add_special = body.prompt, body.add_special_tokens
            tokens = await engine.run_in_engine_thread(
                lambda: engine.tokenizer.encode(text, add_special_tokens=add_special)
            )
        return TokenizeResponse(tokens=tokens, count=len(tokens),
                                max_model_len=engine.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        completion.check_model(body.model)
        vocab_size = engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(
                f"token id {bad[0]} is out of range for a vocabulary of {vocab_size}",
                param="tokens",
            )
        if engine.tokenizer is None:
            raise OpenAIError("this model has no tokenizer")
        text = await engine.run_in_engine_thread(engine.tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    return app


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
    except Exception as exc:  # this request fails; the server and the engine loop go on
        logger.exception("request failed")
        raise OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500,
                          type="internal_server_error") from None


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status_code)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_to_openai(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        return _error_response(OpenAIError(str(exc.detail), exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return _error_response(OpenAIError(
            f"internal error: {type(exc).__name__}: {exc}", 500, type="internal_server_error"
        ))


def _validation_to_openai(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's first complaint, as OpenAI words a 400: the message names the field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return OpenAIError(f"malformed JSON body: {detail}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Unions report one error per branch with the branch type in loc; keep the field path.
    path = ".".join(p for p in loc if not _is_type_tag(p))
    if not path:
        return OpenAIError(f"invalid request body: {first['msg']}")
    if first.get("type") == "missing":
        return OpenAIError(f"missing required field: {path}", param=path)
    return OpenAIError(f"invalid value for {path}: {first['msg']}", param=path)


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict")


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


async def serve(
    engine: AsyncLLMEngine,
    sock: socket.socket,
    api_key: str | None = None,
    on_ready: Callable[[str], None] | None = None,
    log_level: str = "warning",
) -> None:
    """Serve the app on an already bound socket until interrupted."""
    import uvicorn

    app = build_app(engine, api_key)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        if on_ready is not None:
            on_ready(url)

    announcer = asyncio.ensure_future(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()
