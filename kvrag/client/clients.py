"""The two clients of ``kvrag serve``: :class:`Client` (blocking) and :class:`AsyncClient`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
from httpx_sse import EventSource

from kvrag.client.wire import Fold, chat_body, check, root_url, text_body, whole
from kvrag.engine.types import Generation, GenerationStream, WarmResult
from kvrag.errors import ServerError

__all__ = ["Client", "AsyncClient", "AsyncGenerationStream"]


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
        self.base_url = root_url(base_url)
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

    def _engine_default(self, call: tuple[str, dict[str, Any]], card: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """A generation call without ``max_tokens`` gets the server engine's default, as the embedded
        engine's calls do (a plain OpenAI request gets the rest of the context window)."""
        path, body = call
        if body.get("max_tokens") is None:
            body = {**body, "max_tokens": card.get("kvrag", {}).get("max_new_tokens")}
        return path, body

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
        tenant: sent in the tenant header (a server started with ``--trust-tenant-header`` takes it as the
            cache namespace; any other refuses it).
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
        check(response)
        return response.json()

    def _stream(self, path: str, body: dict[str, Any]) -> GenerationStream:
        try:
            response = self._http.send(self._http.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if not response.is_success:
            response.read()
            response.close()
            check(response)
        return GenerationStream(self._pieces(response))

    def _pieces(self, response: httpx.Response) -> Iterator[str]:
        fold = Fold()
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
            **options: ``max_new_tokens`` (or ``max_tokens``; unset: the server engine's default, as the
                embedded engine's), ``temperature``, ``top_p``, ``stop``,
                ``seed``, ``mode``, ``recompute_ratio``, ``selection``, ``quality``, ``conversation_id``, ``dedup``;
                ``constraint`` (a :class:`~kvrag.Constraint`: a JSON schema or any JSON object, sent as
                ``response_format``); ``tools`` (OpenAI function schemas) and ``tool_choice`` (``"auto"``,
                ``"none"``, ``"required"``/``"any"``, a tool's name): the answer's calls come back in
                :attr:`~kvrag.client.wire.ServedGeneration.tool_calls`; ``model`` instead of the client's.
        """
        path, body = self._defaults(chat_body(messages, documents, options, self.model, False))
        return whole(self._request("POST", path, body))

    def stream_chat(self, messages, *, documents: Sequence[str] | None = None, **options: Any) -> GenerationStream:
        """Like :meth:`chat`, streamed: yields text pieces; ``.generation`` once exhausted; ``close()`` stops it."""
        return self._stream(*self._defaults(chat_body(messages, documents, options, self.model, True)))

    def complete(self, prompt: str, *, documents: Sequence[str] | None = None, **options: Any) -> Generation:
        """Continue a prompt string as it is (no chat template); arguments as for :meth:`chat`."""
        path, body = self._defaults(text_body(prompt, documents, options, self.model, False))
        return whole(self._request("POST", path, body))

    def stream_complete(self, prompt: str, *, documents: Sequence[str] | None = None, **options: Any):
        """Like :meth:`complete`, streamed (see :meth:`stream_chat`)."""
        return self._stream(*self._defaults(text_body(prompt, documents, options, self.model, True)))

    def _defaults(self, call: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        return self._engine_default(call, self.model_card()) if call[1].get("max_tokens") is None else call

    # -- documents, conversations, the server -------------------------------------------------------

    def register(self, documents: Sequence[str]) -> list[str]:
        """Register texts with the server as chunk boundaries for every later prompt; their content ids."""
        return self._request("POST", "/v1/documents", {"documents": list(documents)})["ids"]

    def warm(self, documents: Sequence[str], *, order: str = "given") -> WarmResult:
        """Register texts and compute their KV now, for this client's tenant (``order`` as
        :meth:`kvrag.Engine.warm`'s: ``"similar"`` for a corpus)."""
        body = {"documents": list(documents), "warm": True, "order": order}
        return WarmResult(**self._request("POST", "/v1/documents", body)["warm"])

    def record_retrieval(self, documents: Sequence[str], *, order: str = "retrieval") -> list[int]:
        """Register one retrieval's documents, counted in the server's chunk-access table for this
        client's tenant; the order to put them in (as :meth:`kvrag.Engine.record_retrieval`)."""
        body = {"documents": list(documents), "chunk_order": order}
        return self._request("POST", "/v1/documents", body)["order"]

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

    def __init__(self, pieces: AsyncIterator[str], fold: Fold) -> None:
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
        check(response)
        return response.json()

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncGenerationStream:
        try:
            response = await self._http.send(self._http.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if not response.is_success:
            await response.aread()
            await response.aclose()
            check(response)
        fold = Fold()
        return AsyncGenerationStream(self._pieces(response, fold), fold)

    async def _pieces(self, response: httpx.Response, fold: Fold) -> AsyncIterator[str]:
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
        path, body = await self._defaults(chat_body(messages, documents, options, self.model, False))
        return whole(await self._request("POST", path, body))

    async def stream_chat(self, messages, *, documents: Sequence[str] | None = None, **options: Any):
        """See :meth:`Client.stream_chat`; ``aclose()`` stops it."""
        return await self._stream(*await self._defaults(chat_body(messages, documents, options, self.model, True)))

    async def complete(self, prompt: str, *, documents: Sequence[str] | None = None, **options: Any) -> Generation:
        """See :meth:`Client.complete`."""
        path, body = await self._defaults(text_body(prompt, documents, options, self.model, False))
        return whole(await self._request("POST", path, body))

    async def stream_complete(self, prompt: str, *, documents: Sequence[str] | None = None, **options: Any):
        """See :meth:`Client.stream_complete`."""
        return await self._stream(*await self._defaults(text_body(prompt, documents, options, self.model, True)))

    async def _defaults(self, call: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        return self._engine_default(call, await self.model_card()) if call[1].get("max_tokens") is None else call

    async def register(self, documents: Sequence[str]) -> list[str]:
        """See :meth:`Client.register`."""
        return (await self._request("POST", "/v1/documents", {"documents": list(documents)}))["ids"]

    async def warm(self, documents: Sequence[str], *, order: str = "given") -> WarmResult:
        """See :meth:`Client.warm`."""
        body = {"documents": list(documents), "warm": True, "order": order}
        data = await self._request("POST", "/v1/documents", body)
        return WarmResult(**data["warm"])

    async def record_retrieval(self, documents: Sequence[str], *, order: str = "retrieval") -> list[int]:
        """See :meth:`Client.record_retrieval`."""
        body = {"documents": list(documents), "chunk_order": order}
        return (await self._request("POST", "/v1/documents", body))["order"]

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
