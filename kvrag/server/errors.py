"""Every failure of ``kvrag serve`` as one OpenAI-shaped answer: ``{"error": {"message", "type",
"param", "code"}}``, whatever raised it.

kvrag's own errors, validation errors and HTTP errors say what was wrong with the request; anything
else is a fault of the server: it is logged with the request's id (also in the ``X-Request-Id``
header of every answer) and answered with a 500 that carries the id and no traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from kvrag.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError, OverloadedError
from kvrag.server.settings import AuthenticationError, LimitError

log = logging.getLogger("kvrag.server")

__all__ = ["REQUEST_ID_HEADER", "BodyTooLargeError", "error_body", "error_of"]

#: The response header naming a request's id (the id the server's log names it by).
REQUEST_ID_HEADER = "X-Request-Id"


class BodyTooLargeError(LimitError):
    """A request body past ``max_body_bytes`` (HTTP 413), announced or read."""


def error_body(message: str, *, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_of(exc: BaseException, request_id: str | None = None) -> tuple[int, dict[str, Any]]:
    """An exception as (HTTP status, OpenAI error body); a server fault is logged here, with its id."""
    if isinstance(exc, OverloadedError):  # the engine's queue is full: come back later
        return 503, error_body(str(exc), type="server_error", code="overloaded")
    if isinstance(exc, AuthenticationError):
        return 401, error_body(str(exc), type="invalid_request_error", code="invalid_api_key")
    if isinstance(exc, ModelNotFoundError):
        return 404, error_body(str(exc), type="invalid_request_error", code="model_not_found", param="model")
    if isinstance(exc, ContextLengthError):
        body = error_body(str(exc), type="invalid_request_error", code="context_length_exceeded")
        body["error"].update(prompt_tokens=exc.prompt_tokens, limit=exc.limit)  # kvrag's client rebuilds the error
        return 400, body
    if isinstance(exc, BodyTooLargeError):
        return 413, error_body(str(exc), type="invalid_request_error", code="request_too_large")
    if isinstance(exc, LimitError):
        return 400, error_body(str(exc), type="invalid_request_error", code="limit_exceeded", param=exc.param)
    if isinstance(exc, InvalidRequestError):  # a field at fault names itself (kvrag.server.structured.FieldError)
        return 400, error_body(str(exc), type="invalid_request_error", param=getattr(exc, "param", None))
    if isinstance(exc, RequestValidationError):
        return 400, _validation(exc)
    if isinstance(exc, HTTPException):
        return exc.status_code, error_body(str(exc.detail), type="invalid_request_error")
    log.error("kvrag serve: request %s failed", request_id, exc_info=exc)
    message = f"internal server error (request id {request_id}; the server's log has the details)"
    return 500, error_body(message, type="server_error", code="internal_error")


def _validation(exc: RequestValidationError) -> dict[str, Any]:
    """A body that does not parse: every unknown field named at once, else the first problem."""
    errors = exc.errors()
    unknown = [_where(e) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        message = (
            f"unknown field(s) {', '.join(unknown)}: kvrag serve does not take them (it would rather refuse "
            "a field than ignore what it asks for)"
        )
        return error_body(message, type="invalid_request_error", param=unknown[0], code="unknown_field")
    first = errors[0] if errors else {}
    where = _where(first)
    message = f"{where or 'request'}: {first.get('msg', 'invalid request')}"
    return error_body(message, type="invalid_request_error", param=where or None)


def _where(error: dict) -> str:
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body")
