"""``KVCachedLLM``: a LlamaIndex LLM over the kvrag engine.

Every call renders one prompt string (the model's own chat template), hands it to the engine as
``prompt=``, and the engine finds the registered node texts inside it (see
:class:`~kvrag.integrations.llama_index.nodes.KVCachedNodePostprocessor`). With ``base_url`` the
messages (or the prompt string) go to a ``kvrag serve`` server instead, with the recorded node
texts they hold. Fields, per-call arguments, the engine lookup, the figures and the async bridge
are those of :mod:`kvrag.integrations._shared`; one iterator over an engine call serves every
entry point: completion and chat, sync and async, streaming or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from typing import Any, TypeVar

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
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
from pydantic import BaseModel

from kvrag.config import Constraint
from kvrag.engine import Engine, Generation
from kvrag.engine.tools import ToolFormat, ToolStream, engine_tool_format, parse_tool_calls, tool_request
from kvrag.errors import InvalidRequestError, UnsupportedModelError
from kvrag.integrations._shared import (
    EngineCall,
    GenerationFields,
    Prompt,
    call_metadata,
    check_engine_choice,
    open_in_thread,
    usage,
)
from kvrag.integrations.llama_index.conversation import current_conversation
from kvrag.integrations.llama_index.tools import calls_metadata, openai_tools, template_message, tool_selections

__all__ = ["KVCachedLLM", "generation_info"]

R = TypeVar("R", CompletionResponse, ChatResponse)


def generation_info(
    gen: Generation, *, model_name: str | None = None, conversation_id: str | None = None
) -> tuple[dict, dict]:
    """What a finished generation did, as (``additional_kwargs``, ``raw``) of a LlamaIndex response.

    ``additional_kwargs`` is flat (TTFT, cache read, chunk hits/misses, recomputed tokens: the keys
    of :data:`kvrag.integrations._shared.METADATA_KEYS`, the same as LangChain's
    ``response_metadata``); ``raw["usage"]`` has the token counts LlamaIndex's
    ``TokenCountingHandler`` reads, and ``raw["kvrag"]`` the engine's full
    :class:`~kvrag.engine.types.GenerationStats`.
    """
    info = call_metadata(gen, model_name=model_name, conversation_id=conversation_id)
    return info, {"usage": usage(gen), "kvrag": gen.stats.to_dict()}


def _completion(text: str, delta: str | None, extra: dict, calls: Sequence = ()) -> CompletionResponse:
    return CompletionResponse(text=text, delta=delta, **extra)


def _chat(text: str, delta: str | None, extra: dict, calls: Sequence = ()) -> ChatResponse:
    message = ChatMessage(role=MessageRole.ASSISTANT, content=text, additional_kwargs=calls_metadata(calls))
    return ChatResponse(message=message, delta=delta, **extra)


def _figures(call: EngineCall, gen: Generation) -> dict:
    info, raw = generation_info(gen, model_name=call.model_name, conversation_id=call.conversation_id)
    return {"additional_kwargs": info, "raw": raw}


Respond = Callable[..., R]


def _responses(call: EngineCall, respond: Respond, fmt: ToolFormat | None = None) -> Iterator[R]:
    """The one iterator: cumulative ``text`` plus ``delta`` per piece; the last carries the figures. With
    a tool format the calls are split from the text as they complete (each response has those so far)."""
    text, calls = "", []
    stream = ToolStream(fmt) if fmt is not None else None
    with closing(call):
        for piece, gen in call:
            if gen is None:
                if stream is not None:
                    piece, found = stream.feed(piece)
                    calls.extend(found)
                    if not piece and not found:
                        continue
                text += piece
                yield respond(text, piece, {}, calls)
            elif stream is None:  # no tools, or a kvrag server's calls (base_url=), parsed there
                yield respond(gen.text, "", _figures(call, gen), list(getattr(gen, "tool_calls", ())))
            else:
                rest, found = stream.finish()
                yield respond(text + rest, rest, _figures(call, gen), [*calls, *found])


def _response(call: EngineCall, respond: Respond, fmt: ToolFormat | None = None) -> R:
    gen = call.finish()
    served = list(getattr(gen, "tool_calls", ()))  # a kvrag server's calls (base_url=), parsed there
    text, calls = parse_tool_calls(gen.text, fmt) if fmt is not None else (gen.text, served)
    return respond(text, None, _figures(call, gen), calls)


class KVCachedLLM(GenerationFields, FunctionCallingLLM):
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
        model: the model (``None`` = bundled SmolLM2-135M-Instruct; or a local directory / ``.gguf``;
            with ``base_url``, the served model's name).
        base_url, api_key, tenant: a ``kvrag serve`` server to call instead of loading an engine
            (same responses and metadata keys), its API key, the tenant header's value.
        engine_config: :class:`~kvrag.EngineConfig` fields for the shared engine (dtype, ...).
        mode, recompute_ratio, selection, quality, max_new_tokens, temperature, top_p, stop, seed: generation
            defaults (``None`` = the engine config's); each can be overridden per call, as can
            ``model`` (another shared engine). ``max_tokens`` is accepted per call for ``max_new_tokens``.
        conversation_id: conversation of this LLM's chat calls (multi-turn KV reuse, see below).
        dedup: in a conversation, drop chunks an earlier turn already placed in the prompt
            (CRAFT); ``None`` = the engine config's default.
        context_window: context window reported to LlamaIndex (default: the engine's).

    Tools (a ``FunctionCallingLLM``: ``FunctionAgent``, ``chat_with_tools``, ``predict_and_call``): they are
    rendered with the model's own chat template and its calls parsed in its family's format
    (:mod:`kvrag.engine.tools`: Qwen2.5/Qwen3, Llama 3.x, Mistral; ``is_function_calling_model`` says
    whether the model has one); ``tool_required`` forces a call with a grammar constraint.
    ``structured_predict`` constrains decoding to the output class's JSON schema.

    Conversations: the engine keeps a conversation's last turn (prompt + answer KV) and reuses it
    in the next turn's prompt. The conversation comes from the ``conversation_id`` argument of a
    call (any call), else from this LLM's ``conversation_id`` or an enclosing
    :func:`~kvrag.integrations.llama_index.conversation` block, which apply to *chat* calls only:
    LlamaIndex chat engines answer through ``chat`` and make their side calls (condensing the
    question, summaries) through ``complete``, which must not replace the kept turn.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    max_new_tokens: int | None = Field(default=None, ge=0, description="Generation length limit.")
    conversation_id: str | None = Field(default=None, description="Conversation of chat calls (multi-turn).")
    context_window: int | None = Field(default=None, description="Context window reported to LlamaIndex.")

    _engine: Engine | None = PrivateAttr(default=None)

    def __init__(self, engine: Engine | None = None, **data: Any) -> None:
        check_engine_choice(engine, data.get("model"), data.get("engine_config"), data.get("base_url"))
        super().__init__(**data)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVCachedLLM"

    # -- engine and metadata ----------------------------------------------------------------------

    def _given_engine(self) -> Engine | None:
        return self._engine

    @property
    def engine(self) -> Engine:
        """The engine (the shared one is loaded on first access)."""
        return self.get_engine()

    @property
    def metadata(self) -> LLMMetadata:
        server = self.server()
        if server is not None:  # the served model's card, asked once
            card = server.client.model_card()
            name, window, default_output = card["id"], card["max_model_len"], card["kvrag"]["max_new_tokens"]
            tools = bool(card["kvrag"].get("tool_calling"))
        else:
            engine = self.engine
            name, window, default_output = (
                engine.model_name,
                engine.context_window,
                engine.config.sampling.max_new_tokens,
            )
            tools = _has_tools(engine)
        return LLMMetadata(
            context_window=self.context_window or window,
            num_output=self.max_new_tokens if self.max_new_tokens is not None else default_output,
            is_chat_model=True,
            is_function_calling_model=tools,
            model_name=name,
        )

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids of ``text`` (usable as ``Settings.tokenizer`` for exact packing; needs the engine)."""
        return self.engine.prompt_tokenizer.tokenize(text)

    def node_postprocessor(self, **kwargs: Any):
        """A :class:`KVCachedNodePostprocessor` registering retrieved nodes with this LLM's engine."""
        from kvrag.integrations.llama_index.nodes import KVCachedNodePostprocessor

        return KVCachedNodePostprocessor(llm=self, **kwargs)

    def end_conversation(self, conversation_id: str | None = None) -> bool:
        """Free a conversation's kept KV (default: this LLM's ``conversation_id``); False if not live."""
        cid = conversation_id or self.conversation_id
        if cid is None:
            raise InvalidRequestError("no conversation_id given and none set on this LLM")
        return super().end_conversation(cid)

    # -- prompt building (shared by every entry point) -------------------------------------------

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> Prompt:
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return Prompt.plain(self.messages_to_prompt(messages))
        rendered = [template_message(m) for m in messages]
        if not rendered:
            raise InvalidRequestError("no messages given")
        return Prompt.chat(rendered)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict) -> tuple[Prompt, ToolFormat | None, dict]:
        """A chat call's prompt, tool format (None without tools) and engine arguments: ``tools`` (OpenAI
        function schemas) rendered by the template, ``tool_choice`` forcing a call by grammar."""
        kwargs = dict(kwargs)
        tools, choice = kwargs.pop("tools", None), kwargs.pop("tool_choice", None)
        prompt = self._chat_prompt(messages)
        if not tools or choice == "none":
            return prompt, None, kwargs
        if prompt.messages is None:
            raise InvalidRequestError(
                "tools are rendered by the model's chat template: not with messages_to_prompt set"
            )
        if self.base_url is not None:  # the server renders the tools, forces a call as asked, parses the calls
            return Prompt.chat(prompt.messages, tools, choice), None, kwargs
        fmt, tools, forced = tool_request(self.get_engine(kwargs.get("model")), tools, choice)
        if forced is not None:
            if kwargs.get("constraint") is not None:
                raise InvalidRequestError("a forced tool call is a constraint: give tool_choice or constraint")
            kwargs["constraint"] = forced
        return Prompt.chat(prompt.messages, tools), fmt, kwargs

    def _completion_prompt(self, prompt: str, formatted: bool) -> Prompt:
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
        if formatted or self.completion_to_prompt is not default_completion_to_prompt:
            return Prompt.plain(prompt if formatted else self.completion_to_prompt(prompt))
        messages = [ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt)] if self.system_prompt else []
        return self._chat_prompt([*messages, ChatMessage(role=MessageRole.USER, content=prompt)])

    # -- the engine call ----------------------------------------------------------------------------

    def _start(self, prompt: Prompt, kwargs: dict, chat: bool) -> EngineCall:
        """Validate and start a call. ``conversation_id`` falls back to this LLM's (and the
        enclosing :func:`conversation` block's) for chat calls only."""
        defaults = self.call_defaults()
        defaults["conversation_id"] = (self.conversation_id or current_conversation()) if chat else None
        return self.start_call(prompt, kwargs, defaults)

    # -- completion ---------------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _response(self._start(self._completion_prompt(prompt, formatted), kwargs, False), _completion)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return _responses(self._start(self._completion_prompt(prompt, formatted), kwargs, False), _completion)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        rendered = self._completion_prompt(prompt, formatted)
        return await asyncio.to_thread(lambda: _response(self._start(rendered, kwargs, False), _completion))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        rendered = self._completion_prompt(prompt, formatted)
        return await open_in_thread(lambda: _responses(self._start(rendered, kwargs, False), _completion))

    # -- chat -----------------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, fmt, kwargs = self._chat_request(messages, kwargs)
        return _response(self._start(prompt, kwargs, True), _chat, fmt)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, fmt, kwargs = self._chat_request(messages, kwargs)
        return _responses(self._start(prompt, kwargs, True), _chat, fmt)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, fmt, kwargs = await asyncio.to_thread(self._chat_request, messages, kwargs)
        return await asyncio.to_thread(lambda: _response(self._start(prompt, kwargs, True), _chat, fmt))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt, fmt, kwargs = await asyncio.to_thread(self._chat_request, messages, kwargs)
        return await open_in_thread(lambda: _responses(self._start(prompt, kwargs, True), _chat, fmt))

    # -- tools and structured output ------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The ``chat`` arguments of a call with ``tools``: ``tool_required`` forces a call (any tool),
        ``tool_choice`` a tool's name forces that one."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg
            )
        choice = tool_choice if tool_choice is not None else ("required" if tool_required else "auto")
        return {"messages": messages, "tools": openai_tools(tools) or None, "tool_choice": choice, **kwargs}

    def _validate_chat_with_tools_response(
        self, response: ChatResponse, tools: Sequence[Any], allow_parallel_tool_calls: bool = False, **kwargs: Any
    ) -> ChatResponse:
        """Without ``allow_parallel_tool_calls`` only the first call is kept."""
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not allow_parallel_tool_calls and len(calls) > 1:
            response.message.additional_kwargs["tool_calls"] = calls[:1]
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The tool calls of a response (``ValueError`` if there are none and ``error_on_no_tool_call``)."""
        return tool_selections(response, error_on_no_tool_call)

    def structured_predict(
        self, output_cls: type[BaseModel], prompt: Any, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> BaseModel:
        """An ``output_cls`` from the prompt's answer, decoding constrained to the class's JSON schema
        (pydantic's ``ValidationError`` if the answer is cut short by ``max_new_tokens``)."""
        messages = prompt.format_messages(llm=self, **prompt_args)
        constraint = Constraint.json_schema(output_cls.model_json_schema())
        response = self.chat(messages, constraint=constraint, **(llm_kwargs or {}))
        return output_cls.model_validate_json(response.message.content or "")

    async def astructured_predict(
        self, output_cls: type[BaseModel], prompt: Any, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> BaseModel:
        """:meth:`structured_predict` in a worker thread."""
        return await asyncio.to_thread(self.structured_predict, output_cls, prompt, llm_kwargs, **prompt_args)


def _has_tools(engine: Engine) -> bool:
    try:
        engine_tool_format(engine)
    except UnsupportedModelError:
        return False
    return True
