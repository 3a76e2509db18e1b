"""The ``kvrag serve`` application: OpenAI's completion endpoints over one embedded :class:`~kvrag.Engine`.

Endpoints:

- ``POST /v1/chat/completions``, ``POST /v1/completions``: OpenAI's shapes, streamed as
  server-sent events with ``"stream": true``; kvrag's request fields and ``kvrag`` response field
  are described in :mod:`kvrag.server.protocol`.
- ``POST /v1/documents``: ``{"documents": [...], "warm": bool, "order": "given"|"similar"}`` registers texts as chunk
  boundaries (any prompt that contains one reuses its KV, whatever client sent it) and, with
  ``warm``, computes their KV now for the request's tenant. With ``"chunk_order": "retrieval"|"frequency"``
  the documents are one retrieval's results: counted in the tenant's chunk-access table
  (:meth:`~kvrag.Engine.record_retrieval`), and the answer's ``order`` says where to put them
  (indices into ``documents``; CRAFT's frequency order, or as given).
- ``DELETE /v1/conversations/{id}``: forget a conversation's kept KV.
- Speculation (RAGCache's speculative pipelining, for a client whose vector search reports its
  candidates in stages): a completion request with ``"speculate": KEY`` is not answered but
  prefilled in idle engine time (:meth:`~kvrag.Engine.speculate_request`) and answered at once with
  ``{"object": "speculation", ...}``; the same request sent later without ``speculate`` (same
  prompt, documents and settings) adopts that prefill, anything else runs afresh. ``/v1/documents``
  with ``"speculate": KEY`` computes the texts' missing KV the same way (:meth:`~kvrag.Engine.speculate`).
  A newer speculation of a key cancels the older one (the list changed); ``DELETE
  /v1/speculations/{KEY}`` cancels a key's (the final list differs). Keys are per tenant.
- ``GET /v1/models`` (the served model; ``max_model_len`` is its context window), ``GET /health``
  (with the engine thread's queue: :meth:`~kvrag.Engine.queue_stats`),
  ``GET /metrics`` (Prometheus text, :mod:`kvrag.server.metrics`).

Engine calls run in worker threads (:func:`~kvrag.calls.open_in_thread`): the event
loop only moves bytes. A client that disconnects stops its request: the worker closes the
engine stream after the token it is computing, which frees the request's KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.exceptions import HTTPException

import kvrag
from kvrag.calls import EngineCall, open_in_thread
from kvrag.engine import Engine, RequestOptions
from kvrag.errors import ContextLengthError, InvalidRequestError, KvragError, ModelNotFoundError, OverloadedError
from kvrag.server.metrics import CONTENT_TYPE_LATEST, Metrics, RequestTrack
from kvrag.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DocumentsRequest,
    StreamShape,
    chat_response,
    completion_response,
    error_body,
    figures,
)
from kvrag.server.settings import AuthenticationError, ServerSettings

log = logging.getLogger(__name__)

__all__ = ["create_app"]


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    """An ASGI app serving ``engine`` (run it with uvicorn, or ``kvrag serve``).

    Args:
        engine: the engine; it is shared by every request (its calls are thread-safe).
        settings: served model name, tenants, overload answer (:class:`ServerSettings`).
    """
    server = _Server(engine, settings or ServerSettings())
    app = FastAPI(title="kvrag serve", version=kvrag.__version__)
    app.state.kvrag = server

    for exc_type in (KvragError, RequestValidationError, HTTPException):
        app.add_exception_handler(exc_type, server.error_response)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": server.model_name, "queue": server.engine.queue_stats()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict:
        server.check_model(model)
        return server.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        namespace = server.admit(request, body)
        messages = body.chat_messages()
        return await server.generate(request, body, namespace, lambda e: e.apply_chat_template(messages), "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        namespace = server.admit(request, body)
        prompt = body.prompt_text()
        return await server.generate(request, body, namespace, lambda e: prompt, "text")

    @app.post("/v1/documents")
    async def documents(body: DocumentsRequest, request: Request) -> dict:
        namespace = server.tenants.namespace(request.headers)
        if body.speculate is not None and (body.warm or body.chunk_order is not None):
            raise InvalidRequestError(
                "give speculate alone: a speculation is neither warm work nor a retrieval to count"
            )
        ids = await asyncio.to_thread(engine.register, body.documents, namespace=namespace)
        if body.speculate is not None:
            key = _speculation_key(namespace, body.speculate)
            handle = await asyncio.to_thread(engine.speculate, body.documents, namespace=namespace, key=key)
            return {
                "object": "documents",
                "ids": ids,
                "warm": None,
                "speculation": _speculation(body.speculate, handle),
            }
        order = None
        if body.chunk_order is not None:  # one retrieval: counted, and ordered as asked
            order = engine.record_retrieval(body.documents, order=body.chunk_order, namespace=namespace)
        warm = None
        if body.warm:
            res = await asyncio.to_thread(engine.warm, body.documents, order=body.order, namespace=namespace)
            warm = dataclasses.asdict(res)  # every WarmResult field: the client builds one from it
        out = {"object": "documents", "ids": ids, "warm": warm}
        if order is not None:
            out["order"] = order
        return out

    @app.delete("/v1/speculations/{key}")
    async def cancel_speculations(key: str, request: Request) -> dict:
        namespace = server.tenants.namespace(request.headers)
        cancelled = engine.speculations.cancel_key(_speculation_key(namespace, key), namespace=namespace)
        return {"id": key, "object": "speculation.deleted", "deleted": cancelled}

    @app.delete("/v1/conversations/{conversation_id}")
    async def end_conversation(conversation_id: str, request: Request) -> dict:
        namespace = server.tenants.namespace(request.headers)
        ended = await asyncio.to_thread(engine.end_conversation, conversation_id, namespace=namespace)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": ended}

    return app


class _Server:
    """What the routes share: the engine, settings, metrics; the generation path; error answers."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tenants = settings.tenants
        self.model_name = settings.model_name or engine.model_name
        self.metrics = Metrics()
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, "default"):
            raise ModelNotFoundError(
                f"the model {name!r} is not served here; this server serves {self.model_name!r} (or say 'default')"
            )

    def model_card(self) -> dict[str, Any]:
        cfg = self.engine.config
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvrag",
            "max_model_len": self.engine.context_window,
            "kvrag": {
                "max_new_tokens": cfg.sampling.max_new_tokens,
                "mode": cfg.mode,
                "recompute_ratio": cfg.recompute_ratio,
                "selection": cfg.selection,
            },
        }

    # -- generation ---------------------------------------------------------------------------------

    def admit(self, request: Request, body: ChatRequest | CompletionRequest) -> str | None:
        """The request's tenant, once its key, model and settings are known to be acceptable."""
        namespace = self.tenants.namespace(request.headers)
        self.check_model(body.model)
        body.check_supported()
        return namespace

    async def generate(
        self,
        request: Request,
        body: ChatRequest | CompletionRequest,
        namespace: str | None,
        render: Callable[[Engine], str],
        kind: Literal["chat", "text"],
    ) -> Response:
        """Start the engine call in a worker thread (it validates the rest); answer whole or as a stream."""
        options = body.engine_options(namespace)
        documents = body.documents
        engine = self.engine
        if body.speculate is not None:
            return await self.speculate(body.speculate, namespace, documents, render, options)

        def start() -> EngineCall:
            if documents:
                engine.register(documents, namespace=namespace)
            stream = engine.stream(prompt=render(engine), options=options)
            return EngineCall(stream, model_name=self.model_name, conversation_id=options.conversation_id)

        track = self.metrics.track(request.url.path)
        try:
            items = await open_in_thread(start)
        except BaseException:
            track.end("error")
            raise
        shape = StreamShape(kind, model=self.model_name, include_usage=body.include_usage)
        if body.stream:
            return EventSourceResponse(self._events(items, shape, track, options.conversation_id))
        return await self._whole(request, items, kind, track, options.conversation_id)

    async def speculate(
        self,
        key: str,
        namespace: str | None,
        documents: list[str] | None,
        render: Callable[[Engine], str],
        options: RequestOptions,
    ) -> JSONResponse:
        """Prefill the request ahead (a speculation of ``key``) and answer at once (202)."""
        engine = self.engine

        def start():
            if documents:
                engine.register(documents, namespace=namespace)
            return engine.speculate_request(
                prompt=render(engine), key=_speculation_key(namespace, key), options=options
            )

        handle = await asyncio.to_thread(start)
        return JSONResponse(_speculation(key, handle), status_code=202)

    def _figures(self, generation, conversation_id: str | None) -> dict[str, Any]:
        self.metrics.finished(generation)
        return figures(generation, model_name=self.model_name, conversation_id=conversation_id)

    async def _whole(self, request: Request, items, kind: str, track: RequestTrack, conversation_id) -> Response:
        generation = None
        async with aclosing(items):
            try:
                async for _, generation in items:
                    track.started()
                    if generation is not None:
                        break
                    if await request.is_disconnected():  # nobody will read the answer: stop computing it
                        track.end("cancelled")
                        return Response(status_code=204)
            except BaseException:
                track.end("error")
                raise
        track.end("ok")
        extension = self._figures(generation, conversation_id)
        respond = chat_response if kind == "chat" else completion_response
        return JSONResponse(respond(generation, model=self.model_name, extension=extension))

    async def _events(self, items, shape: StreamShape, track: RequestTrack, conversation_id) -> AsyncIterator[bytes]:
        """The SSE body; a client that goes away cancels it, which closes ``items`` (and the engine stream)."""
        outcome = "cancelled"
        try:
            async with aclosing(items):
                for chunk in shape.opening():
                    yield _sse(chunk)
                async for piece, generation in items:
                    track.started()
                    if generation is None:
                        if piece:
                            yield _sse(shape.piece(piece))
                        continue
                    for chunk in shape.closing(generation, self._figures(generation, conversation_id)):
                        yield _sse(chunk)
            yield format_sse_event(data_str="[DONE]")
            outcome = "ok"
        except Exception as exc:  # after the headers: the error goes in the stream, in OpenAI's shape
            outcome = "error"
            status, body = self._error(exc)
            log.log(logging.ERROR if status >= 500 else logging.INFO, "kvrag serve: stream failed: %s", exc)
            yield _sse(body)
        finally:
            track.end(outcome)

    # -- errors ---------------------------------------------------------------------------------------

    def _error(self, exc: Exception) -> tuple[int, dict[str, Any]]:
        """An exception as (HTTP status, OpenAI error body)."""
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
        if isinstance(exc, InvalidRequestError):
            return 400, error_body(str(exc), type="invalid_request_error")
        if isinstance(exc, RequestValidationError):
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            message = f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid request')}"
            return 400, error_body(message, type="invalid_request_error", param=".".join(loc) or None)
        if isinstance(exc, HTTPException):
            return exc.status_code, error_body(str(exc.detail), type="invalid_request_error")
        log.exception("kvrag serve: request failed", exc_info=exc)
        return 500, error_body(f"{type(exc).__name__}: {exc}", type="server_error")

    async def error_response(self, request: Request, exc: Exception) -> JSONResponse:
        status, body = self._error(exc)
        headers = {"Retry-After": str(self.settings.retry_after_s)} if status == 503 else None
        return JSONResponse(body, status_code=status, headers=headers)


def _speculation_key(namespace: str | None, key: str) -> tuple:
    """A client's speculation key, scoped to its tenant (one tenant never cancels another's)."""
    return ("serve", namespace, key)


def _speculation(key: str, handle) -> dict[str, Any]:
    return {"id": key, "object": "speculation", "kind": handle.kind, "state": handle.state, "tokens": handle.tokens}


def _sse(obj: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(obj))
