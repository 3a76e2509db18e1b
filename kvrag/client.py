"""kvrag's client for ``kvrag serve``: sync (:class:`Client`) and async (:class:`AsyncClient`).

The calls mirror the engine's: results are :class:`~kvrag.engine.Generation` objects with the
server engine's :class:`~kvrag.engine.GenerationStats` (chunk hits, cached and recomputed tokens,
TTFT as the engine measured it), streams yield text pieces and hold ``.generation`` once
exhausted, and bad requests raise the same :mod:`kvrag.errors` classes as the engine::

    from kvrag.client import Client

    with Client("http://127.0.0.1:8000") as client:
        client.warm(passages)                       # once: register and precompute a corpus
        gen = client.chat([{"role": "user", "content": prompt}], max_new_tokens=32)
        print(gen.text, gen.stats.chunk_hits, gen.stats.cached_tokens)
        for piece in (stream := client.stream_chat(messages, documents=retrieved)):
            print(piece, end="")
        print(stream.generation.ttft_s)

``documents=`` names the texts of this request's prompt that are chunks (registered with the
server for this request); texts registered before (:meth:`Client.register`, :meth:`Client.warm`)
need not be sent again. Token ids are not sent over HTTP: ``Generation.token_ids`` is empty.
Needs ``pip install "kvrag[client]"`` (httpx).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
from httpx_sse import EventSource

from kvrag.engine.requests import RequestArgs
from kvrag.engine.types import Generation, GenerationStats, GenerationStream, WarmResult
from kvrag.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError, ServerError

__all__ = ["Client", "AsyncClient", "AsyncGenerationStream", "REQUEST_OPTIONS"]

#: Per-request keywords of the client's calls (the engine's, less what the server decides) and
#: their names on the wire. ``max_tokens`` is accepted for ``max_new_tokens``.
REQUEST_OPTIONS = {
    **{name: name for name in RequestArgs.__annotations__ if name not in ("prompt", "sampling", "namespace")},
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
}


def _root(base_url: str) -> str:
    """The server's root URL (an OpenAI-style base URL ending in ``/v1`` is accepted too)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _body(options: dict[str, Any], *, model: str, documents: Sequence[str] | None, stream: bool) -> dict[str, Any]:
    options = dict(options)
    model = options.pop("model", None) or model
    unknown = sorted(set(options) - REQUEST_OPTIONS.keys())
    if unknown:
        raise InvalidRequestError(f"unknown argument(s) {', '.join(unknown)}; give model, {', '.join(REQUEST_OPTIONS)}")
    body: dict[str, Any] = {"model": model, "stream": stream}
    for name, value in options.items():
        if value is None:
            continue
        wire = REQUEST_OPTIONS[name]
        if body.get(wire, value) != value:
            raise InvalidRequestError("max_new_tokens and max_tokens are one argument; give one of them")
        body[wire] = list(value) if name == "stop" and not isinstance(value, str) else value
    if documents is not None:
        if isinstance(documents, str) or not all(isinstance(d, str) for d in documents):
            raise InvalidRequestError("documents must be a list of strings")
        body["documents"] = list(documents)
    return body


def _chat_body(messages, documents, options, model, stream) -> tuple[str, dict[str, Any]]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body = _body(options, model=model, documents=documents, stream=stream)
    return "/v1/chat/completions", {**body, "messages": list(messages)}


def _text_body(prompt, documents, options, model, stream) -> tuple[str, dict[str, Any]]:
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
    return "/v1/completions", {**_body(options, model=model, documents=documents, stream=stream), "prompt": prompt}


def _error(status: int | None, body: Any, retry_after: str | None = None) -> Exception:
    """The :mod:`kvrag.errors` exception of an OpenAI error body (answer or stream event)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return ServerError(f"kvrag server answered {status}: {str(body)[:300]}", status_code=status)
    message, code = str(err.get("message", "")), err.get("code")
    if code == "context_length_exceeded" and "prompt_tokens" in err and "limit" in err:
        return ContextLengthError(int(err["prompt_tokens"]), int(err["limit"]))
    if code == "model_not_found":
        return ModelNotFoundError(message)
    if err.get("type") == "invalid_request_error" and status in (None, 400, 422):
        return InvalidRequestError(message)
    retry = float(retry_after) if retry_after and retry_after.replace(".", "", 1).isdigit() else None
    return ServerError(message or f"kvrag server answered {status}", status_code=status, code=code, retry_after=retry)


def _check(response: httpx.Response) -> None:
    """Raise the answer's error unless it is a success (the body must have been read)."""
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = response.text
    raise _error(response.status_code, body, response.headers.get("retry-after"))


def _generation(text: str, finish_reason: str, extension: Any) -> Generation:
    if not isinstance(extension, dict) or "stats" not in extension:
        raise ServerError("the server's answer has no kvrag figures: is it a kvrag server?")
    stats = GenerationStats.from_dict(extension["stats"])
    return Generation(text, [], finish_reason, extension["ttft_s"], extension["total_s"], stats)


def _whole(data: dict[str, Any]) -> Generation:
    """The :class:`Generation` of a whole chat or text completion."""
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return _generation(text or "", choice["finish_reason"], data.get("kvrag"))


class _Fold:
    """Reads a stream's events one by one: their text pieces, then the :class:`Generation`."""

    def __init__(self) -> None:
        self.text = ""
        self.finish_reason: str | None = None
        self.extension: Any = None
        self.finished = False  # the ``[DONE]`` event came

    def take(self, data: str) -> list[str]:
        """The text piece an event's data carries (none or one); raises the error an event carries."""
        if data == "[DONE]":
            self.finished = True
            return []
        event = json.loads(data)
        if "error" in event:
            raise _error(None, event)
        if "kvrag" in event:
            self.extension = event["kvrag"]
        piece = ""
        for choice in event.get("choices") or ():
            piece += (choice["delta"].get("content") if "delta" in choice else choice.get("text")) or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.text += piece
        return [piece] if piece else []

    def generation(self) -> Generation:
        if self.finish_reason is None:
            raise ServerError("the server's stream ended before the answer did")
        return _generation(self.text, self.finish_reason, self.extension)


class _Base:
    """What both clients share: the server's address, headers, the model card; ``_http`` is set by each."""

    _http_class: type = httpx.Client

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        tenant: str | None = None,
        tenant_header: str = "X-Kvrag-Tenant",
        model: str = "default",
        timeout: float = 600.0,
    ) -> None:
        self.base_url = _root(base_url)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if tenant is not None:
            headers[tenant_header] = tenant
        self._http = self._http_class(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(timeout, connect=10)
        )
        self._model_card: dict[str, Any] | None = None

    def _unreachable(self, exc: httpx.HTTPError) -> ServerError:
        return ServerError(f"cannot reach the kvrag server at {self.base_url}: {exc}")

    def _served(self, data: dict[str, Any]) -> dict[str, Any]:
        cards = data.get("data") or []
        if not cards:
            raise ServerError(f"the server at {self.base_url} serves no model")
        self._model_card = cards[0]
        return self._model_card


class Client(_Base):
    """A blocking client of one ``kvrag serve`` server (thread-safe: one connection pool).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        api_key: sent as ``Authorization: Bearer`` (servers started with API keys need one).
        tenant: sent in the tenant header (servers without API keys take it as the cache namespace).
        tenant_header: that header's name.
        model: the model named in requests (``default``: whatever the server serves).
        timeout: seconds to wait for the server (a long prefill included).
    """

    _http_class = httpx.Client

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        _check(response)
        return response.json()

    def _stream(self, path: str, body: dict[str, Any]) -> GenerationStream:
        try:
            response = self._http.send(self._http.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if not response.is_success:
            response.read()
            response.close()
            _check(response)
        return GenerationStream(self._pieces(response))

    def _pieces(self, response: httpx.Response) -> Iterator[str]:
        fold = _Fold()
        try:
            for event in EventSource(response).iter_sse():
                yield from fold.take(event.data)
                if fold.finished:
                    break
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        finally:
            response.close()  # also what tells the server to stop, when the stream is closed early
        return fold.generation()

    # -- generation ---------------------------------------------------------------------------------

    def chat(self, messages, *, documents: Sequence[str] | None = None, **options: Any) -> Generation:
        """Answer chat messages (``[{"role", "content"}]``, or one string as a user message).

        Args:
            messages: the conversation; the server renders it with the model's chat template.
            documents: texts of the prompt that are chunks (their KV is reused when cached).
            **options: ``max_new_tokens`` (or ``max_tokens``), ``temperature``, ``top_p``, ``stop``,
                ``seed``, ``mode``, ``recompute_ratio``, ``selection``, ``conversation_id``, ``dedup``;
                ``model`` instead of the client's.
        """
        path, body = _chat_body(messages, documents, options, self.model, False)
        return _whole(self._request("POST", path, body))

    def stream_chat(self, messages, *, documents: Sequence[str] | None = None, **options: Any) -> GenerationStream:
        """Like :meth:`chat`, streamed: yields text pieces; ``.generation`` once exhausted; ``close()`` stops it."""
        return self._stream(*_chat_body(messages, documents, options, self.model, True))

    def complete(self, prompt: str, *, documents: Sequence[str] | None = None, **options: Any) -> Generation:
        """Continue a prompt string as it is (no chat template); arguments as for :meth:`chat`."""
        path, body = _text_body(prompt, documents, options, self.model, False)
        return _whole(self._request("POST", path, body))

    def stream_complete(self, prompt: str, *, documents: Sequence[str] | None = None, **options: Any):
        """Like :meth:`complete`, streamed (see :meth:`stream_chat`)."""
        return self._stream(*_text_body(prompt, documents, options, self.model, True))

    # -- documents, conversations, the server -------------------------------------------------------

    def register(self, documents: Sequence[str]) -> list[str]:
        """Register texts with the server as chunk boundaries for every later prompt; their content ids."""
        return self._request("POST", "/v1/documents", {"documents": list(documents)})["ids"]

    def warm(self, documents: Sequence[str]) -> WarmResult:
        """Register texts and compute their KV now, for this client's tenant."""
        return WarmResult(
            **self._request("POST", "/v1/documents", {"documents": list(documents), "warm": True})["warm"]
        )

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation's kept KV on the server; False if it was not live."""
        return self._request("DELETE", f"/v1/conversations/{conversation_id}")["deleted"]

    def model_card(self) -> dict[str, Any]:
        """The served model (``id``, ``max_model_len``, kvrag's defaults), asked once."""
        return self._model_card or self._served(self._request("GET", "/v1/models"))

    def health(self) -> bool:
        """True when the server answers ``/health``."""
        try:
            return self._http.get("/health").is_success
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGenerationStream:
    """An async iterator over text pieces; ``generation`` holds the result once exhausted."""

    def __init__(self, pieces: AsyncIterator[str], fold: _Fold) -> None:
        self._pieces = pieces
        self._fold = fold
        self.generation: Generation | None = None

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await anext(self._pieces)
        except StopAsyncIteration:
            self.generation = self._fold.generation()
            raise

    async def aclose(self) -> None:
        """Stop generating (the server frees the request)."""
        await self._pieces.aclose()


class AsyncClient(_Base):
    """The async twin of :class:`Client` (same arguments, same calls, awaited)."""

    _http_class = httpx.AsyncClient

    async def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            response = await self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        _check(response)
        return response.json()

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncGenerationStream:
        try:
            response = await self._http.send(self._http.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if not response.is_success:
            await response.aread()
            await response.aclose()
            _check(response)
        fold = _Fold()
        return AsyncGenerationStream(self._pieces(response, fold), fold)

    async def _pieces(self, response: httpx.Response, fold: _Fold) -> AsyncIterator[str]:
        try:
            async for event in EventSource(response).aiter_sse():
                for piece in fold.take(event.data):
                    yield piece
                if fold.finished:
                    break
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        finally:
            await response.aclose()

    async def chat(self, messages, *, documents: Sequence[str] | None = None, **options: Any) -> Generation:
        """See :meth:`Client.chat`."""
        path, body = _chat_body(messages, documents, options, self.model, False)
        return _whole(await self._request("POST", path, body))

    async def stream_chat(self, messages, *, documents: Sequence[str] | None = None, **options: Any):
        """See :meth:`Client.stream_chat`; ``aclose()`` stops it."""
        return await self._stream(*_chat_body(messages, documents, options, self.model, True))

    async def complete(self, prompt: str, *, documents: Sequence[str] | None = None, **options: Any) -> Generation:
        """See :meth:`Client.complete`."""
        path, body = _text_body(prompt, documents, options, self.model, False)
        return _whole(await self._request("POST", path, body))

    async def stream_complete(self, prompt: str, *, documents: Sequence[str] | None = None, **options: Any):
        """See :meth:`Client.stream_complete`."""
        return await self._stream(*_text_body(prompt, documents, options, self.model, True))

    async def register(self, documents: Sequence[str]) -> list[str]:
        """See :meth:`Client.register`."""
        return (await self._request("POST", "/v1/documents", {"documents": list(documents)}))["ids"]

    async def warm(self, documents: Sequence[str]) -> WarmResult:
        """See :meth:`Client.warm`."""
        data = await self._request("POST", "/v1/documents", {"documents": list(documents), "warm": True})
        return WarmResult(**data["warm"])

    async def end_conversation(self, conversation_id: str) -> bool:
        """See :meth:`Client.end_conversation`."""
        return (await self._request("DELETE", f"/v1/conversations/{conversation_id}"))["deleted"]

    async def model_card(self) -> dict[str, Any]:
        """See :meth:`Client.model_card`."""
        return self._model_card or self._served(await self._request("GET", "/v1/models"))

    async def health(self) -> bool:
        """See :meth:`Client.health`."""
        try:
            return (await self._http.get("/health")).is_success
        except httpx.HTTPError:
            return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
