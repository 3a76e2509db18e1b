"""``KVCachedLLM``: a LangChain chat model over the kvrag engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from kvrag.errors import InvalidRequestError
from kvrag.integrations._shared import Prompt, template_role
from kvrag.integrations.langchain._common import EngineSettings, engine_pieces

__all__ = ["KVCachedLLM", "to_chat_messages"]


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
        role = m.role if m.type == "chat" else template_role(m.type)  # type: ignore[attr-defined]
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
    ``response_metadata`` carries ``ttft_s``, ``cache_read``, ``chunk_hits``, ``chunk_misses``,
    ``recomputed_tokens``, ``mode`` and more (the keys of
    :data:`kvrag.integrations._shared.METADATA_KEYS`, the same as LlamaIndex's responses).
    Per-call arguments: ``max_tokens`` (or ``max_new_tokens``), ``temperature``, ``top_p``,
    ``seed``, ``mode``, ``recompute_ratio``, ``selection``, ``quality``, ``dedup``, ``conversation_id``,
    ``model``; anything else is an :class:`~kvrag.InvalidRequestError`.
    """

    # unknown constructor keywords are errors (LangChain's base models ignore them)
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    @property
    def _llm_type(self) -> str:
        return "kvrag-chat"

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        prompt = Prompt.chat(to_chat_messages(messages))
        for text, info in engine_pieces(self, prompt, stop, kwargs, run_manager):
            if info is None:
                if text:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=text))
                continue
            usage = info.pop("usage_metadata")
            message = AIMessageChunk(content="", usage_metadata=usage, response_metadata=info, chunk_position="last")
            yield ChatGenerationChunk(message=message)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
