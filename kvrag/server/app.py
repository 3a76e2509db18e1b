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

Before a route runs, :class:`~kvrag.server.guard.Guard` has checked the API key and the body's size
(before reading it); a route checks the request's :class:`~kvrag.server.settings.Limits` before the
engine sees it. Every failure is one OpenAI-shaped error (:mod:`kvrag.server.errors`).

``max_tokens`` defaults to the rest of the context window (as vLLM's); a prompt and ``max_tokens``
that do not fit it together are a 400, as vLLM's. Both count the prompt's tokens as one text (a
prompt split at documents may hold a few more: the engine then trims the answer to the window).

Engine calls run in worker threads (:func:`~kvrag.calls.open_in_thread`): the event loop only moves
bytes. A client that disconnects stops its request wherever it is: queued, prefilling (at the
prefill's next pause) or decoding; the engine frees the request's KV.
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
from kvrag.errors import ContextLengthError, InvalidRequestError, KvragError, ModelNotFoundError
from kvrag.server.errors import error_of
from kvrag.server.guard import Guard
from kvrag.server.limits import check_documents, check_id, check_messages, check_prompt, check_stop, utf8_size
from kvrag.server.metrics import CONTENT_TYPE_LATEST, Metrics, RequestTrack
from kvrag.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DocumentsRequest,
    StreamShape,
    chat_response,
    completion_response,
    figures,
)
from kvrag.server.settings import ServerSettings
from kvrag.server.structured import ToolPlan, check_constraint, one_constraint, renders_tools, tool_plan

log = logging.getLogger(__name__)

__all__ = ["create_app"]


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    """An ASGI app serving ``engine`` (run it with uvicorn, or ``kvrag serve``).

    Args:
        engine: the engine; it is shared by every request (its calls are thread-safe).
        settings: served model name, tenants, limits, overload answer (:class:`ServerSettings`).
    """
    server = _Server(engine, settings or ServerSettings())
    app = FastAPI(title="kvrag serve", version=kvrag.__version__)
    app.state.kvrag = server
    app.add_middleware(Guard, tenants=server.tenants, limits=server.limits)

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
        check_messages(messages, server.limits)
        plan = tool_plan(engine, body.tools, body.tool_choice)
        return await server.generate(request, body, namespace, _chat_render(messages, body, plan), "chat", plan)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        namespace = server.admit(request, body)
        prompt = body.prompt_text()
        return await server.generate(request, body, namespace, lambda e: prompt, "text")

    @app.post("/v1/documents")
    async def documents(body: DocumentsRequest, request: Request) -> dict:
        namespace = request.state.namespace
        check_documents(body.documents, server.limits)
        check_id(body.speculate, "speculate")
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
        check_id(key, "key")
        namespace = request.state.namespace
        cancelled = engine.speculations.cancel_key(_speculation_key(namespace, key), namespace=namespace)
        return {"id": key, "object": "speculation.deleted", "deleted": cancelled}

    @app.delete("/v1/conversations/{conversation_id}")
    async def end_conversation(conversation_id: str, request: Request) -> dict:
        namespace = request.state.namespace
        check_id(conversation_id, "conversation_id")
        ended = await asyncio.to_thread(engine.end_conversation, conversation_id, namespace=namespace)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": ended}

    return app


def _chat_render(messages: list[dict], body: ChatRequest, plan: ToolPlan | None) -> Callable[[Engine], str]:
    """The chat's prompt, rendered by the model's template (with vLLM-shaped documents and the tools when given)."""
    documents = body.template_documents()
    tools = {"tools": plan.tools} if plan is not None else {}

    def render(engine: Engine) -> str:
        try:
            if documents:  # the engine's tokenizer is Hugging Face's: its template takes vLLM's documents
                prompt = engine.tokenizer.apply_chat_template(
                    messages, documents=documents, tokenize=False, add_generation_prompt=True, **tools
                )
            else:
                prompt = engine.apply_chat_template(messages, **tools)
        except Exception as exc:  # the template refuses these messages (e.g. roles that do not alternate)
            raise InvalidRequestError(f"messages: the model's chat template refused them: {exc}") from exc
        for i, d in enumerate(documents):
            if d["text"] not in prompt:
                raise InvalidRequestError(
                    f"documents[{i}]: the model's chat template does not place documents in the prompt; "
                    "put their text in the messages and send them as strings"
                )
        return prompt

    return render


class _Server:
    """What the routes share: the engine, settings, metrics; the generation path; error answers."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tenants = settings.tenants
        self.limits = settings.limits
        self.model_name = settings.model_name or engine.model_name
        self.metrics = Metrics(engine)
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
                "tool_calling": renders_tools(self.engine),
            },
        }

    # -- generation ---------------------------------------------------------------------------------

    def admit(self, request: Request, body: ChatRequest | CompletionRequest) -> str | None:
        """The request's tenant, once its model, settings and sizes are known to be acceptable."""
        self.check_model(body.model)
        body.check_supported()
        check_stop(body.stop, self.limits)
        check_id(body.conversation_id, "conversation_id")
        check_id(body.speculate, "speculate")
        if body.documents is not None and body.kvrag_documents is not None:
            raise InvalidRequestError("give documents or kvrag_documents (the same chunks), not both")
        check_documents(body.chunk_texts(), self.limits)
        for i, d in enumerate(body.template_documents()):
            utf8_size(d.get("title", ""), f"documents[{i}].title")
        return request.state.namespace

    def prepare(
        self, body: ChatRequest | CompletionRequest, namespace: str | None, render, plan: ToolPlan | None = None
    ) -> tuple[str, RequestOptions]:
        """The request's prompt and options (a worker thread: rendering, counting tokens and compiling a
        constraint take time).

        ``max_tokens`` unset: the rest of the context window; set past it: a 400, as vLLM's.
        """
        constraint = one_constraint(body.constraint(), plan)
        forced = plan is not None and plan.constraint is not None  # a forced call's grammar holds the tools' schemas
        check_constraint(self.engine, constraint, "tools" if forced else "response_format")
        prompt = render(self.engine)
        check_prompt(prompt, self.limits)
        window = self.engine.context_window
        n = self.engine.count_tokens(prompt)
        if n >= window:
            raise ContextLengthError(n, window)
        asked = body.max_new_tokens
        if asked is not None and n + asked > window:
            raise ContextLengthError(n, window, f"and max_tokens={asked}: {n} + {asked} > {window}")
        options = body.engine_options(namespace, window - n if asked is None else asked, constraint)
        texts = body.chunk_texts()
        if texts:
            self.engine.register(texts, namespace=namespace)
        return prompt, options

    async def generate(
        self,
        request: Request,
        body: ChatRequest | CompletionRequest,
        namespace: str | None,
        render: Callable[[Engine], str],
        kind: Literal["chat", "text"],
        plan: ToolPlan | None = None,
    ) -> Response:
        """Start the engine call in a worker thread (it validates the rest); answer whole or as a stream.
        ``plan``: the chat's tools (:func:`~kvrag.server.structured.tool_plan`), None without."""
        engine = self.engine
        if body.speculate is not None:
            return await self.speculate(body, namespace, render, plan)
        call: list[EngineCall] = []

        def start() -> EngineCall:
            prompt, options = self.prepare(body, namespace, render, plan)
            stream = engine.stream(prompt=prompt, options=options)
            call.append(EngineCall(stream, model_name=self.model_name, conversation_id=body.conversation_id))
            return call[0]

        track = self.metrics.track(request.url.path)
        try:
            items = await open_in_thread(start)
        except BaseException:
            track.end("error")
            raise
        fmt = plan.fmt if plan is not None else None
        shape = StreamShape(kind, model=self.model_name, include_usage=body.include_usage, tools=fmt)
        rid = request.state.request_id
        if body.stream:
            return EventSourceResponse(self._events(items, call[0], shape, track, body.conversation_id, rid))
        return await self._whole(request, items, call[0], kind, track, body.conversation_id, fmt)

    async def speculate(
        self, body, namespace: str | None, render: Callable[[Engine], str], plan: ToolPlan | None = None
    ) -> JSONResponse:
        """Prefill the request ahead (a speculation of ``body.speculate``) and answer at once (202)."""
        key = body.speculate

        def start():
            prompt, options = self.prepare(body, namespace, render, plan)
            return self.engine.speculate_request(prompt=prompt, key=_speculation_key(namespace, key), options=options)

        handle = await asyncio.to_thread(start)
        return JSONResponse(_speculation(key, handle), status_code=202)

    def _figures(self, generation, conversation_id: str | None) -> dict[str, Any]:
        self.metrics.finished(generation)
        return figures(generation, model_name=self.model_name, conversation_id=conversation_id)

    async def _whole(
        self, request: Request, items, call: EngineCall, kind: str, track: RequestTrack, conversation_id, fmt=None
    ) -> Response:
        generation = None
        watch = asyncio.create_task(_close_on_disconnect(request, call))
        try:
            async with aclosing(items):
                async for _, generation in items:
                    track.started()
                    if generation is not None:
                        break
        except BaseException:
            track.end("error")
            raise
        finally:
            watch.cancel()
        if generation is None:  # the client went away: the call was closed wherever it was
            track.end("cancelled")
            return Response(status_code=204)
        track.end("ok")
        extension = self._figures(generation, conversation_id)
        if kind == "chat":
            return JSONResponse(chat_response(generation, model=self.model_name, extension=extension, tools=fmt))
        return JSONResponse(completion_response(generation, model=self.model_name, extension=extension))

    async def _events(
        self, items, call: EngineCall, shape: StreamShape, track: RequestTrack, conversation_id, request_id: str
    ) -> AsyncIterator[bytes]:
        """The SSE body; a client that goes away cancels it, which closes ``items`` and the engine call."""
        outcome = "cancelled"
        try:
            async with aclosing(items):
                for chunk in shape.opening():
                    yield _sse(chunk)
                async for piece, generation in items:
                    track.started()
                    if generation is None:
                        for chunk in shape.pieces(piece) if piece else ():
                            yield _sse(chunk)
                        continue
                    for chunk in shape.closing(generation, self._figures(generation, conversation_id)):
                        yield _sse(chunk)
            yield format_sse_event(data_str="[DONE]")
            outcome = "ok"
        except Exception as exc:  # after the headers: the error goes in the stream, in OpenAI's shape
            outcome = "error"
            status, body = error_of(exc, request_id)
            if status < 500:
                log.info("kvrag serve: request %s: stream failed: %s", request_id, exc)
            yield _sse(body)
        finally:
            call.close()  # thread-safe: a call still queued or prefilling leaves the engine now
            track.end(outcome)

    # -- errors ---------------------------------------------------------------------------------------

    async def error_response(self, request: Request, exc: Exception) -> JSONResponse:
        status, body = error_of(exc, getattr(request.state, "request_id", None))
        headers = {"Retry-After": str(self.settings.retry_after_s)} if status == 503 else None
        return JSONResponse(body, status_code=status, headers=headers)


async def _close_on_disconnect(request: Request, call: EngineCall) -> None:
    """Close ``call`` once the client disconnects (its body is read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            call.close()
            return


def _speculation_key(namespace: str | None, key: str) -> tuple:
    """A client's speculation key, scoped to its tenant (one tenant never cancels another's)."""
    return ("serve", namespace, key)


def _speculation(key: str, handle) -> dict[str, Any]:
    return {"id": key, "object": "speculation", "kind": handle.kind, "state": handle.state, "tokens": handle.tokens}


def _sse(obj: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(obj))
