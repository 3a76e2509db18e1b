"""``KVCachedLLM``: a LangChain chat model over the kvrag engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from kvrag.errors import InvalidRequestError
from kvrag.integrations.langchain._common import (
    EngineSettings,
    engine_pieces,
    iterate_in_thread,
    metadata,
    usage,
)

__all__ = ["KVCachedLLM", "to_chat_messages"]

_ROLES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "ai": "assistant",
    "tool": "tool",
    "function": "tool",
}


def _text(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidRequestError(f"KVCachedLLM takes text messages only; got a {kind!r} content block")
    return "".join(parts)


def to_chat_messages(messages: list[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as ``[{"role", "content"}]`` for the model's chat template."""
    out = []
    for m in messages:
        role = m.role if m.type == "chat" else _ROLES.get(m.type)  # type: ignore[attr-defined]
        if role is None:
            raise InvalidRequestError(f"unsupported message type {m.type!r}")
        out.append({"role": role, "content": _text(m)})
    return out


class KVCachedLLM(EngineSettings, BaseChatModel):
    """A chat model that reuses the KV cache of the documents in its prompt.

    Drop it in where a chain uses a chat model: the chain's prompt is rendered with the model's
    own chat template, the documents that a :class:`KVCachedRetriever` (or
    :class:`KVCachedVectorStore`, :func:`register_documents`) recorded are found in it, and their
    cached KV is reused (CacheBlend). Construction is cheap; the engine loads on first use.

    Example:
        .. code-block:: python

            llm = KVCachedLLM(max_tokens=64)              # bundled SmolLM2-135M-Instruct
            retriever = KVCachedRetriever(retriever=vectorstore.as_retriever(), llm=llm)
            chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm

    Conversation identity (multi-turn KV reuse, chunk deduplication) comes from the run config:
    ``configurable`` ``session_id`` / ``thread_id`` / ``conversation_id``, or ``conversation_id``
    in ``metadata``, or a ``conversation_id=`` call argument.

    ``usage_metadata.input_token_details.cache_read`` counts prompt tokens whose KV was reused;
    ``response_metadata`` carries ``ttft_s``, ``chunk_hits``, ``chunk_misses``,
    ``recomputed_tokens``, ``mode`` and more.
    """

    # unknown constructor keywords are errors (LangChain's base models ignore them)
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    @property
    def _llm_type(self) -> str:
        return "kvrag-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = stop or self.stop
        if stops:
            params["ls_stop"] = stops
        return params

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        chat = to_chat_messages(messages)
        for text, generation in engine_pieces(self, lambda e: e.apply_chat_template(chat), stop, kwargs, run_manager):
            if generation is None:
                if text:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=text))
                continue
            meta = metadata(generation, self.model_label(kwargs.get("model")), kwargs.get("conversation_id"))
            yield ChatGenerationChunk(
                message=AIMessageChunk(
                    content="", usage_metadata=usage(generation), response_metadata=meta, chunk_position="last"
                )
            )

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        sync_manager = run_manager.get_sync() if run_manager is not None else None
        async for chunk in iterate_in_thread(lambda: self._stream(messages, stop, sync_manager, **kwargs)):
            yield chunk

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
