"""Routes of the web pages: GET / and /ui (chat), /ui/engine (engine view), their static
files under /ui/static/, and GET /v1/engine/state (behind the API key, like the model routes).

The pages load no inline script and nothing from elsewhere: every response here carries a
Content-Security-Policy that allows only this origin's own scripts and styles, so markup in
model output could not run even if the page's renderer let some through.
"""
from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING

import orjson
from fastapi import APIRouter, Depends
from fastapi.responses import Response

from pagedllm.entrypoints.openai.protocol import ErrorResponse
from pagedllm.entrypoints.web.schema import EngineState
from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine.async_engine import AsyncLLMEngine

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache"}
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def _static_files() -> dict[str, tuple[bytes, str]]:
    """Every shipped file by name, read once: name -> (content, media type)."""
    folder = resources.files("pagedllm.entrypoints.web") / "static"
    files = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in _TYPES:
            files[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    return files


class GenerationCounter:
    """Counts generated tokens (an OutputObserver): the engine view's throughput chart."""

    def __init__(self) -> None:
        self.total = 0

    def on_output(self, output: RequestOutput) -> None:
        self.total += sum(len(ids) for _, ids in output.deltas)

    def on_abort(self, request_id: str) -> None:
        pass


def build_web_router(engine: AsyncLLMEngine, check_api_key: Callable) -> APIRouter:
    """The pages' routes and the engine-state route. `check_api_key` is the app's key
    dependency: the pages load without a key and ask for one when the API answers 401."""
    files = _static_files()
    counter = GenerationCounter()
    engine.observers.append(counter)
    router = APIRouter()

    def page(name: str) -> Response:
        content, media_type = files[name]
        return Response(content, media_type=media_type, headers=_HEADERS)

    @router.get("/", include_in_schema=False)
    @router.get("/ui", include_in_schema=False)
    async def chat_page() -> Response:
        return page("chat.html")

    @router.get("/ui/engine", include_in_schema=False)
    async def engine_page() -> Response:
        return page("engine.html")

    @router.get("/ui/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> Response:
        if name not in files:
            return Response(status_code=404, headers=_HEADERS)
        return page(name)

    @router.get("/v1/engine/state", dependencies=[Depends(check_api_key)],
                responses={200: {"model": EngineState, "description": "The snapshot"},
                           401: {"model": ErrorResponse,
                                 "description": "Missing or wrong API key (when set)"}})
    async def get_engine_state() -> Response:
        """The scheduler's queues, the KV block pool and counters, read between two steps
        (docs/engine_state.md)."""
        state = await engine.engine_state()
        state["counters"]["generation_tokens"] = counter.total
        # orjson: a tenth of the stdlib's time for the ~50 kB of 256 running sequences.
        return Response(orjson.dumps(state), media_type="application/json")

    return router
