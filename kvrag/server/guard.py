"""The server's front door: a pure ASGI middleware that runs before FastAPI reads a byte of the body.

For every HTTP request, in order:

1. gives it an id (``X-Request-Id`` on the answer; the log names failures by it);
2. finds its tenant from the headers (:meth:`~kvrag.server.settings.TenantMap.namespace`): a missing
   or unknown API key is refused here, before the body is read, on every path but :data:`OPEN_PATHS`;
3. refuses a body announced (``Content-Length``) or read past ``max_body_bytes`` (413), reading
   it at most that far, then hands the app the body it read; a refusal before the body was read
   whole closes the connection (``Connection: close``), so the rest of the body is never read;
4. answers any exception the app lets through with an OpenAI-shaped error
   (:func:`~kvrag.server.errors.error_of`): never Starlette's plain-text 500.

The tenant and the id reach the routes as ``request.state.namespace`` and ``request.state.request_id``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvrag.server.errors import REQUEST_ID_HEADER, BodyTooLargeError, error_of, log
from kvrag.server.settings import Limits, TenantMap

__all__ = ["Guard", "OPEN_PATHS"]

#: Paths any caller may read, key or not: the health check and the API's description.
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class Guard:
    """The ASGI middleware described in the module docstring.

    Args:
        app: the application behind it.
        tenants: how a request's headers name its tenant.
        limits: the server's limits (``max_body_bytes`` is checked here).
    """

    def __init__(self, app: ASGIApp, *, tenants: TenantMap, limits: Limits) -> None:
        self.app, self.tenants, self.limit = app, tenants, limits.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), _id_header(request_id)]}
            await send(message)

        body: bytes | None = None
        try:
            headers = Headers(scope=scope)
            if scope["path"] not in OPEN_PATHS:
                state["namespace"] = self.tenants.namespace(headers)
            body = await self._read_body(headers, receive)
            await self.app(scope, _replay(body, receive), send_with_id)
        except Exception as exc:
            if started:  # the answer is under way (a stream): nothing more can be said to the client
                log.error("kvrag serve: request %s failed after its answer started", request_id, exc_info=exc)
                return
            status, payload = error_of(exc, request_id)
            await _send_json(send_with_id, status, payload, close=body is None)

    async def _read_body(self, headers: Headers, receive: Receive) -> bytes:
        """The request's body, refused (413) as soon as it is announced or read past the limit."""
        announced = headers.get("content-length")
        if announced is not None and announced.strip().isdigit() and int(announced) > self.limit:
            raise BodyTooLargeError(f"the body is {int(announced)} bytes, past {self.limit}", limit="max_body_bytes")
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise BodyTooLargeError(f"the body is past {self.limit} bytes", limit="max_body_bytes")
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body already read once, then what the client sends next (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _id_header(request_id: str) -> tuple[bytes, bytes]:
    return REQUEST_ID_HEADER.lower().encode("latin-1"), request_id.encode("latin-1")


async def _send_json(send: Send, status: int, payload: dict[str, Any], *, close: bool) -> None:
    """An error answer; ``close``: the connection ends after it (the request's body was not read whole:
    kept alive, the server would read the rest of it, however long, before the next request)."""
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
