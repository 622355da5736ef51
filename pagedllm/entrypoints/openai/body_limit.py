"""A request body limit, enforced before anything parses the body: a pure ASGI middleware."""
from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# What is read and dropped of a refused body before its answer: closing a socket with unread
# bytes resets it, and the client loses the answer; past these bounds it is closed anyway.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 5.0


async def drain(receive: Receive, limit: int = DRAIN_BYTES,
                seconds: float = DRAIN_SECONDS) -> bool:
    """Read and drop the rest of a request body; True when it ended within the bounds."""
    async def read() -> bool:
        size = 0
        while size <= limit:
            message = await receive()
            if message["type"] != "http.request":
                return False
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    try:
        return await asyncio.wait_for(read(), seconds)
    except asyncio.TimeoutError:
        return False


class RequestBodyLimit:
    """Read the whole body before the app runs, counting the bytes as they arrive (so a
    chunked body without Content-Length is bounded too); over max_bytes, answer 413 in
    OpenAI's error shape (Anthropic's on /v1/messages) and close the connection, without
    parsing a byte of it. The rest of the body is drained first (bounded), so the answer
    arrives whole."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            # Expect: 100-continue: the body is not sent until asked for, so do not ask.
            if ("100-continue" not in headers.get("expect", "").lower()
                    and int(declared) <= self.max_bytes + DRAIN_BYTES):
                await drain(receive)
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the end
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await drain(receive)
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks),
                                "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # what comes after the body: the client leaving

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"the request body is larger than this server's limit of "
                   f"{self.max_bytes} bytes (`pagedllm serve --max-request-bytes`)")
        error: dict = {"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": "request_too_large"}}
        if scope.get("path", "").startswith("/v1/messages"):  # Anthropic's routes, its shape
            error = {"type": "error", "error": {"type": "request_too_large", "message": message}}
        response = JSONResponse(error, status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)
