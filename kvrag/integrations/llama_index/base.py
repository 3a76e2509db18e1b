"""``KVCachedLLM``: a LlamaIndex LLM over the kvrag engine.

Every call renders one prompt string (the model's own chat template), hands it to the engine as
``prompt=``, and the engine finds the registered node texts inside it (see
:class:`~kvrag.integrations.llama_index.nodes.KVCachedNodePostprocessor`). One iterator over the
engine's stream serves every entry point: completion and chat, sync and async, streaming or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM, default_completion_to_prompt

from kvrag.config import MODES, SELECTIONS
from kvrag.engine.engine import Engine
from kvrag.engine.types import Generation
from kvrag.errors import InvalidRequestError
from kvrag.integrations.llama_index._threads import aiter_in_thread
from kvrag.integrations.llama_index.conversation import current_conversation

__all__ = ["KVCachedLLM", "generation_info"]

# Per-call keyword arguments accepted by every method, mapped to the engine's names.
_CALL_KWARGS = {
    "max_new_tokens": "max_new_tokens",
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
    "mode": "mode",
    "recompute_ratio": "recompute_ratio",
    "selection": "selection",
    "dedup": "dedup",
}

# LlamaIndex roles that chat templates do not know, mapped to the ones they do.
_ROLES = {"chatbot": "assistant", "model": "assistant", "developer": "system", "function": "tool"}


def generation_info(gen: Generation) -> tuple[dict, dict]:
    """What a finished generation did, as (``additional_kwargs``, ``raw``) of a LlamaIndex response.

    ``additional_kwargs`` is flat (TTFT, cache read, chunk hits/misses, recomputed tokens);
    ``raw["usage"]`` has the token counts LlamaIndex's ``TokenCountingHandler`` reads, and
    ``raw["kvrag"]`` the engine's full :class:`~kvrag.engine.types.GenerationStats`.
    """
    s = gen.stats
    info = {
        "ttft_s": gen.ttft_s,
        "total_s": gen.total_s,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "cache_read": s.cached_tokens,
        "prefix_tokens": s.prefix_tokens,
        "chunk_hits": s.chunk_hits,
        "chunk_misses": s.chunk_misses,
        "recomputed_tokens": s.recomputed_tokens,
        "conversation_tokens": s.conversation_tokens,
        "deduplicated_chunks": s.deduplicated_chunks,
        "compute_fraction": s.compute_fraction,
        "mode": s.mode,
        "recompute_ratio": s.recompute_ratio,
        "finish_reason": gen.finish_reason,
    }
    usage = {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "cache_read": s.cached_tokens,
    }
    return info, {"usage": usage, "kvrag": s.to_dict()}


class KVCachedLLM(LLM):
    """A LlamaIndex LLM that reuses the KV cache of retrieved nodes (CacheBlend fusion).

    Construction is cheap: the engine is loaded on first use and shared process-wide
    (:func:`kvrag.engine.get_engine`, keyed by model and configuration), unless ``engine`` is given.
    Prompts are rendered with the model's own chat template unless ``messages_to_prompt`` /
    ``completion_to_prompt`` are given. Register the retrieved nodes with
    :meth:`node_postprocessor` (or :class:`KVCachedRetriever`) so their KV is reused.

    Example:
        >>> llm = KVCachedLLM()
        >>> qe = index.as_query_engine(llm=llm, node_postprocessors=[llm.node_postprocessor()])

    Args:
        engine: an :class:`~kvrag.Engine` to use instead of the shared one.
        model: the model (``None`` = bundled SmolLM2-135M-Instruct; or a local directory / ``.gguf``).
        engine_config: :class:`~kvrag.EngineConfig` fields for the shared engine (dtype, ...).
        mode, recompute_ratio, selection, max_new_tokens, temperature, top_p, stop, seed: generation
            defaults (``None`` = the engine config's); each can be overridden per call.
        conversation_id: conversation of this LLM's chat calls (multi-turn KV reuse, see below).
        dedup: in a conversation, drop chunks an earlier turn already placed in the prompt
            (CRAFT); ``None`` = the engine config's default.

    Conversations: the engine keeps a conversation's last turn (prompt + answer KV) and reuses it
    in the next turn's prompt. The conversation comes from the ``conversation_id`` argument of a
    call (any call), else from this LLM's ``conversation_id`` or an enclosing
    :func:`~kvrag.integrations.llama_index.conversation` block, which apply to *chat* calls only:
    LlamaIndex chat engines answer through ``chat`` and make their side calls (condensing the
    question, summaries) through ``complete``, which must not replace the kept turn.
        context_window: context window reported to LlamaIndex (default: the engine's).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: str | None = Field(default=None, description="Model: None = bundled SmolLM2-135M-Instruct.")
    engine_config: dict = Field(default_factory=dict, description="EngineConfig fields of the shared engine.")
    mode: str | None = Field(default=None, description=f"Prefill mode: {' | '.join(MODES)}.")
    recompute_ratio: float | None = Field(default=None, description="Share of cached tokens recomputed (blend).")
    selection: str | None = Field(
        default=None, description=f"Which cached tokens blend recomputes: {' | '.join(SELECTIONS)}."
    )
    max_new_tokens: int | None = Field(default=None, description="Generation length limit.")
    temperature: float | None = Field(default=None, description="0 = greedy decoding.")
    top_p: float | None = Field(default=None, description="Nucleus sampling threshold.")
    stop: list[str] | None = Field(default=None, description="Stop strings.")
    seed: int | None = Field(default=None, description="Sampling seed.")
    conversation_id: str | None = Field(default=None, description="Conversation of chat calls (multi-turn).")
    dedup: bool | None = Field(default=None, description="Drop chunks an earlier turn already placed (CRAFT).")
    context_window: int | None = Field(default=None, description="Context window reported to LlamaIndex.")

    _engine: Engine | None = PrivateAttr(default=None)

    def __init__(self, engine: Engine | None = None, **data: Any) -> None:
        if engine is not None and not isinstance(engine, Engine):
            raise InvalidRequestError(f"engine must be a kvrag Engine, got {type(engine).__name__}")
        if engine is not None and (data.get("model") is not None or data.get("engine_config")):
            raise InvalidRequestError("give either engine= or model=/engine_config=, not both")
        super().__init__(**data)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVCachedLLM"

    # -- engine and metadata ----------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine (the shared one is loaded on first access)."""
        if self._engine is None:
            from kvrag.engine import get_engine

            self._engine = get_engine(self.model, **self.engine_config)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.engine
        num_output = self.max_new_tokens if self.max_new_tokens is not None else engine.config.max_new_tokens
        return LLMMetadata(
            context_window=self.context_window or engine.context_window,
            num_output=num_output,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=engine.model_name,
        )

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids of ``text`` (usable as ``Settings.tokenizer`` for exact packing)."""
        return self.engine.planner.tokenize(text)

    def node_postprocessor(self, **kwargs: Any):
        """A :class:`KVCachedNodePostprocessor` registering retrieved nodes with this LLM's engine."""
        from kvrag.integrations.llama_index.nodes import KVCachedNodePostprocessor

        return KVCachedNodePostprocessor(llm=self, **kwargs)

    # -- prompt building (shared by every entry point) -------------------------------------------

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return self.messages_to_prompt(messages)
        rendered = []
        for m in messages:
            content = m.content
            if content is None and m.blocks:
                raise InvalidRequestError("KVCachedLLM takes text messages only (got a non-text content block)")
            role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
            rendered.append({"role": _ROLES.get(role, role), "content": content or ""})
        if not rendered:
            raise InvalidRequestError("no messages given")
        return self.engine.apply_chat_template(rendered)

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
        if formatted:
            return prompt
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(prompt)
        messages = [ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt)] if self.system_prompt else []
        return self._chat_prompt([*messages, ChatMessage(role=MessageRole.USER, content=prompt)])

    # -- the one iterator -------------------------------------------------------------------------

    def end_conversation(self, conversation_id: str | None = None) -> bool:
        """Free a conversation's kept KV (default: this LLM's ``conversation_id``); False if not live."""
        cid = conversation_id or self.conversation_id
        if cid is None:
            raise InvalidRequestError("no conversation_id given and none set on this LLM")
        return self.engine.end_conversation(cid)

    def _request(self, kwargs: dict, chat: bool) -> dict:
        unknown = set(kwargs) - set(_CALL_KWARGS) - {"conversation_id"}
        if unknown:
            raise InvalidRequestError(
                f"unknown argument(s) {', '.join(sorted(unknown))}; KVCachedLLM accepts "
                f"{', '.join(sorted([*_CALL_KWARGS, 'conversation_id']))}"
            )
        req = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "mode": self.mode,
            "recompute_ratio": self.recompute_ratio,
            "selection": self.selection,
            "dedup": self.dedup,
        }
        for name, value in kwargs.items():
            if name in _CALL_KWARGS:
                req[_CALL_KWARGS[name]] = value
        conversation = kwargs.get("conversation_id")
        if conversation is None and chat:
            conversation = self.conversation_id or current_conversation()
        if conversation is not None:
            req["conversation_id"] = conversation
        return req

    def _stream(self, prompt: str, kwargs: dict, chat: bool) -> Iterator[tuple[str, str, Generation | None]]:
        """Validate the request now; the returned iterator yields (text so far, delta, result).

        The last item has an empty delta and the finished :class:`Generation`.
        """
        stream = self.engine.stream(prompt=prompt, **self._request(kwargs, chat))

        def pieces() -> Iterator[tuple[str, str, Generation | None]]:
            text = ""
            try:
                for piece in stream:
                    text += piece
                    yield text, piece, None
            finally:
                stream.close()
            assert stream.generation is not None
            yield stream.generation.text, "", stream.generation

        return pieces()

    @staticmethod
    def _completion(text: str, delta: str | None, gen: Generation | None) -> CompletionResponse:
        if gen is None:
            return CompletionResponse(text=text, delta=delta)
        info, raw = generation_info(gen)
        return CompletionResponse(text=text, delta=delta, additional_kwargs=info, raw=raw)

    @staticmethod
    def _chat(text: str, delta: str | None, gen: Generation | None) -> ChatResponse:
        message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
        if gen is None:
            return ChatResponse(message=message, delta=delta)
        info, raw = generation_info(gen)
        return ChatResponse(message=message, delta=delta, additional_kwargs=info, raw=raw)

    def _run(self, prompt: str, kwargs: dict, chat: bool) -> Generation:
        gen = None
        for *_, gen in self._stream(prompt, kwargs, chat):  # noqa: B007 - the last item holds the result
            pass
        assert gen is not None
        return gen

    # -- completion ---------------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        gen = self._run(self._completion_prompt(prompt, formatted), kwargs, False)
        return self._completion(gen.text, None, gen)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        items = self._stream(self._completion_prompt(prompt, formatted), kwargs, False)
        return (self._completion(*item) for item in items)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        gen = await asyncio.to_thread(lambda: self._run(self._completion_prompt(prompt, formatted), kwargs, False))
        return self._completion(gen.text, None, gen)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        items = await asyncio.to_thread(lambda: self._stream(self._completion_prompt(prompt, formatted), kwargs, False))

        async def gen() -> CompletionResponseAsyncGen:
            async for item in aiter_in_thread(items):
                yield self._completion(*item)

        return gen()

    # -- chat -----------------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        gen = self._run(self._chat_prompt(messages), kwargs, True)
        return self._chat(gen.text, None, gen)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        items = self._stream(self._chat_prompt(messages), kwargs, True)
        return (self._chat(*item) for item in items)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        gen = await asyncio.to_thread(lambda: self._run(self._chat_prompt(messages), kwargs, True))
        return self._chat(gen.text, None, gen)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        items = await asyncio.to_thread(lambda: self._stream(self._chat_prompt(messages), kwargs, True))

        async def gen() -> ChatResponseAsyncGen:
            async for item in aiter_in_thread(items):
                yield self._chat(*item)

        return gen()
