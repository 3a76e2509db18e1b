"""``KVCachedLLM``: a LangChain chat model over the kvrag engine."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict

from kvrag.engine import Engine
from kvrag.engine.tools import check_tools, engine_tool_format, tool_request
from kvrag.errors import InvalidRequestError, UnsupportedModelError
from kvrag.integrations._shared import Prompt
from kvrag.integrations.langchain._common import EngineSettings, engine_pieces
from kvrag.integrations.langchain.structured import (
    structured_runnable,
    to_chat_messages,
    tool_choice_of,
    tool_chunks,
)

__all__ = ["KVCachedLLM", "engine_profile", "to_chat_messages"]


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
    ``seed``, ``constraint`` (a :class:`~kvrag.Constraint`), ``mode``, ``recompute_ratio``, ``selection``,
    ``quality``, ``dedup``, ``conversation_id``, ``model``, and the ``tools`` / ``tool_choice`` that
    :meth:`bind_tools` binds; anything else is an :class:`~kvrag.InvalidRequestError`.

    Tools (:meth:`bind_tools`) and structured output (:meth:`with_structured_output`): which model
    family does what is in ``docs/tools.md``; ``profile`` says it for this model once its engine is known.
    """

    # unknown constructor keywords are errors (LangChain's base models ignore them)
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    @property
    def _llm_type(self) -> str:
        return "kvrag-chat"

    def _resolve_model_profile(self) -> ModelProfile | None:
        # at construction: only an engine given (the shared one loads on first use and fills it then)
        return engine_profile(self.engine) if self.engine is not None else None

    def get_engine(self, model: str | None = None) -> Engine:
        """The engine serving this LLM (see :class:`GenerationFields`); the first one fills ``profile``."""
        engine = super().get_engine(model)
        if self.profile is None and model is None:
            with contextlib.suppress(Exception):  # as LangChain's own: an optional field never fails a call
                self.profile = engine_profile(engine)
        return engine

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, pydantic classes, functions, OpenAI schemas) to this model.

        They are rendered with the model's own chat template and the model's calls are parsed into
        ``AIMessage.tool_calls`` (``tool_call_chunks`` when streaming), in its family's format
        (:mod:`kvrag.engine.tools`: Qwen2.5/Qwen3, Llama 3.x, Mistral). ``tool_choice``: ``"auto"``
        (default: the model decides), ``"none"``, ``"any"``/``"required"``/``True`` (a call is forced by
        a grammar constraint), or a tool's name (that tool is forced). A model whose template renders
        no tools raises :class:`~kvrag.errors.UnsupportedModelError` here when the LLM was given its
        engine, else on the first call.
        """
        formatted = check_tools([convert_to_openai_tool(t) for t in tools])
        choice = tool_choice_of(formatted, tool_choice)
        if self.engine is not None:
            engine_tool_format(self.engine)
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type | None = None,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | Any]:
        """A runnable answering with an object of ``schema`` (a pydantic class: validated instances; a
        JSON schema, TypedDict or OpenAI function schema: dicts).

        ``method``: ``"json_schema"`` (default: decoding is constrained to the schema), ``"json_mode"``
        (any JSON object; the prompt should ask for the fields), ``"function_calling"`` (a forced call of
        a tool whose parameters are the schema; needs a model family with tool calls). With
        ``include_raw`` the result is ``{"raw", "parsed", "parsing_error"}`` and a parse failure is
        reported there instead of raised. A schema is always enforced while decoding (``json_schema``,
        ``function_calling``); ``strict`` (default) also closes its objects (``additionalProperties: false``
        where the schema does not say), ``strict=False`` leaves them as given.
        """
        if kwargs:
            raise InvalidRequestError(f"unknown argument(s) {', '.join(sorted(kwargs))} of with_structured_output")
        return structured_runnable(self, schema, method, include_raw, self.bind_tools, strict)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        tools, choice = kwargs.pop("tools", None), kwargs.pop("tool_choice", None)
        fmt = None
        if not tools or choice == "none":
            prompt = Prompt.chat(to_chat_messages(messages))
        elif self.base_url is not None:  # the server renders the tools, forces a call as asked, parses the calls
            prompt = Prompt.chat(to_chat_messages(messages), tools=tools, tool_choice=choice)
        else:
            fmt, tools, forced = tool_request(self.get_engine(kwargs.get("model")), tools, choice)
            if forced is not None:
                if kwargs.get("constraint") is not None:
                    raise InvalidRequestError("a forced tool call is a constraint: give tool_choice or constraint")
                kwargs["constraint"] = forced
            prompt = Prompt.chat(to_chat_messages(messages), tools=tools)
        pieces = engine_pieces(self, prompt, stop, kwargs, run_manager)
        for message, info in tool_chunks(pieces, fmt):
            if info is None:
                yield ChatGenerationChunk(message=message)
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


def engine_profile(engine: Engine) -> ModelProfile:
    """What a chat model over ``engine`` can do, as LangChain's model profile."""
    try:
        engine_tool_format(engine)
        tools = True
    except UnsupportedModelError:
        tools = False
    return ModelProfile(
        max_input_tokens=engine.context_window,
        max_output_tokens=engine.context_window,
        text_inputs=True,
        text_outputs=True,
        image_inputs=False,
        audio_inputs=False,
        video_inputs=False,
        pdf_inputs=False,
        tool_calling=tools,
        tool_choice=tools,
        tool_call_streaming=tools,
        structured_output=True,
        temperature=True,
    )
