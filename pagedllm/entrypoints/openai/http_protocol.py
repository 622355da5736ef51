"""uvicorn's h11 protocol with what a deployment on an open port needs: a deadline for each
request's head (a connection that never finishes its headers is answered 408 and closed) and
a cap on connections (a request beyond it is answered 503 in OpenAI's error shape).

uvicorn's own `timeout_keep_alive` only runs between requests, after a first response: a
socket that sends part of a request line, or nothing, would be held forever.
"""
from __future__ import annotations

import asyncio
from typing import Any

import h11
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.body_limit import drain

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_MAX_CONNECTIONS = 1000
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
              b"content-length: 29\r\nconnection: close\r\n\r\nthe request head took too long")


def http_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`."""
    return type("PagedH11Protocol", (_Protocol,), {"header_timeout": header_timeout,
                                                   "max_connections": max_connections})


class _Protocol(H11Protocol):
    header_timeout: float
    max_connections: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timer: asyncio.TimerHandle | None = None
        self.app = self.capped_app(self.app)

    def capped_app(self, app: Any) -> Any:
        async def capped(scope: Scope, receive: Receive, send: Send) -> None:
            # This connection and this request's task are in the sets already.
            if (len(self.connections) > self.max_connections
                    or len(self.tasks) > self.max_connections):
                await too_many_connections(self.max_connections, scope, receive, send)
                return
            await app(scope, receive, send)

        return capped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.arm_header_timer()

    def on_response_complete(self) -> None:
        self.arm_header_timer()  # the next request's head has the same deadline
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_header_timer()
        super().connection_lost(exc)

    def arm_header_timer(self) -> None:
        self.cancel_header_timer()
        self.header_timer = self.loop.call_later(self.header_timeout, self.head_timed_out)

    def cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def head_timed_out(self) -> None:
        self.header_timer = None
        # Past IDLE the head has arrived: a request is in flight, not this deadline's concern.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_TIMED_OUT)
            self.transport.close()


async def too_many_connections(cap: int, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
        await drain(receive)  # so the answer is not lost to a reset
    error = {"error": {"message": f"the server has {cap} connections open, its limit "
                                  "(`pagedllm serve --max-connections`); retry later",
                       "type": "server_overloaded", "param": None,
                       "code": "too_many_connections"}}
    response = JSONResponse(error, status_code=503,
                            headers={"Connection": "close", "Retry-After": "1"})
    await response(scope, receive, send)
