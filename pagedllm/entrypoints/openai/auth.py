"""The API key comes before the body: a route's key check marked `key_check` also runs when
its body cannot be read, so a caller without the key learns 401, never what was wrong with
the body. (FastAPI parses a JSON body before it solves a route's dependencies.)"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

from pagedllm.entrypoints.openai.serving_engine import OpenAIError

Check = TypeVar("Check", bound=Callable[[Request], Awaitable[None]])


def key_check(check: Check) -> Check:
    """Mark an `async (request) -> None` dependency that raises a 401 OpenAIError."""
    check.is_key_check = True  # type: ignore[attr-defined]
    return check


async def key_error(request: Request) -> OpenAIError | None:
    """The 401 of the matched route's key check, or None (no route, no check, the key)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return None
    for check in _key_checks(dependant):
        try:
            await check(request)
        except OpenAIError as exc:
            return exc
    return None


def _key_checks(dependant: Any) -> list[Callable]:
    found = []
    for sub in dependant.dependencies:
        if getattr(sub.call, "is_key_check", False):
            found.append(sub.call)
        found.extend(_key_checks(sub))
    return found
