"""Which API's error shape a path answers in: Anthropic's routes (/v1/messages...) answer
{"type": "error", "error": {"type", "message"}}, every other route OpenAI's
{"error": {"message", "type", "param", "code"}}. Errors raised before a route runs (the body
limit, the connection cap, a bad request head, an unknown method) use it too."""
from __future__ import annotations

from typing import Any

ANTHROPIC_PREFIX = "/v1/messages"

# Anthropic's error types by status; anything else is its "api_error".
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         405: "invalid_request_error", 413: "request_too_large",
                         429: "rate_limit_error", 431: "invalid_request_error",
                         503: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(path: str, status: int, message: str, type: str = "invalid_request_error",
               code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The error body for `path`: `type`, `code` and `param` are OpenAI's fields."""
    if is_anthropic(path):
        return anthropic_body(status, message)
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
