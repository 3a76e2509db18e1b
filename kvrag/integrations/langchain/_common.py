"""What the LangChain chat model and text LLM share, on top of :mod:`kvrag.integrations._shared`.

The fields, per-call arguments, engine lookup, figures and async bridge are the shared layer's;
this module adds what is LangChain's own: conversation identity from run configs, LangSmith
parameters, ``usage_metadata``, and the chunk iterator and ``_astream`` both LLM kinds use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, closing
from typing import Any

from langchain_core.runnables.config import RunnableConfig, ensure_config
from pydantic import ConfigDict, Field, model_validator

from kvrag.engine import Engine, Generation
from kvrag.integrations._shared import GenerationFields, Prompt, open_in_thread, usage
from kvrag.integrations._shared.calls import CALL_ARGUMENTS, Mode, call_options, check_engine_choice

__all__ = [
    "EngineSettings",
    "Mode",
    "conversation_from_config",
    "engine_pieces",
    "usage_metadata",
]

#: Keys looked up, in order, in a run config's ``configurable`` and then ``metadata``.
CONVERSATION_KEYS = ("conversation_id", "session_id", "thread_id")

_BUNDLED_NAME = "SmolLM2-135M-Instruct"


class EngineSettings(GenerationFields):
    """Fields and plumbing shared by :class:`KVCachedLLM` and :class:`KVCachedTextLLM`.

    The fields common to every kvrag LLM (model, engine_config, mode, recompute_ratio, selection, quality,
    temperature, top_p, seed, stop, dedup) come from :class:`GenerationFields`; per-call
    arguments are those of :data:`~kvrag.integrations._shared.CALL_ARGUMENTS`.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    engine: Engine | None = Field(default=None, exclude=True)
    """An engine to use instead of the shared one (tests, custom stores)."""
    max_tokens: int | None = Field(default=None, ge=0)
    """Most tokens to generate; ``None`` = engine default."""
    streaming: bool = False
    """Stream internally even for ``invoke`` (token callbacks)."""

    @model_validator(mode="after")
    def _check_engine(self) -> EngineSettings:
        check_engine_choice(self.engine, self.model, self.engine_config, self.base_url)
        return self

    def _given_engine(self) -> Engine | None:
        return self.engine

    def model_label(self, model: str | None = None) -> str:
        """The model's name for tracing and metadata, without loading the engine."""
        if model is not None:
            return model
        if self.model is not None:
            return self.model
        if self.base_url is not None:
            return "default"  # whatever the server serves (not asked here: tracing makes no request)
        return self.engine.model_name if self.engine is not None else _BUNDLED_NAME

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model_label(), "mode": self.mode, "recompute_ratio": self.recompute_ratio}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        """LangSmith's tracing parameters: provider ``kvrag``, the model, the call's settings."""
        params = super()._get_ls_params(stop=stop, **kwargs)
        known = {name: value for name, value in kwargs.items() if name in CALL_ARGUMENTS}
        options = call_options(self.call_defaults(), {**known, "stop": stop}, owner=type(self).__name__)
        params["ls_provider"] = "kvrag"
        params["ls_model_name"] = self.model_label(options["model"])
        for key, name in (("ls_temperature", "temperature"), ("ls_max_tokens", "max_new_tokens"), ("ls_stop", "stop")):
            if options[name] is not None and options[name] != []:
                params[key] = options[name]
            else:
                params.pop(key, None)
        return params

    # LangChain does not hand the run config to ``_stream`` (langchain-core 1.7 calls it without a
    # run manager): read the conversation id from the config here, on the way in.
    def invoke(self, input: Any, config: RunnableConfig | None = None, *, stop=None, **kwargs: Any) -> Any:
        return super().invoke(input, config, stop=stop, **with_conversation(config, kwargs))

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, *, stop=None, **kwargs: Any) -> Any:
        return await super().ainvoke(input, config, stop=stop, **with_conversation(config, kwargs))

    def stream(self, input: Any, config: RunnableConfig | None = None, *, stop=None, **kwargs: Any) -> Iterator[Any]:
        return super().stream(input, config, stop=stop, **with_conversation(config, kwargs))

    def astream(
        self, input: Any, config: RunnableConfig | None = None, *, stop=None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        return super().astream(input, config, stop=stop, **with_conversation(config, kwargs))

    async def _astream(self, input: Any, stop: list[str] | None = None, run_manager: Any = None, **kwargs: Any):
        """``_stream`` driven by one worker thread; closing this generator stops the generation."""
        sync_manager = run_manager.get_sync() if run_manager is not None else None
        stream = await open_in_thread(lambda: self._stream(input, stop, sync_manager, **kwargs))
        async with aclosing(stream):
            async for chunk in stream:
                yield chunk

    # ``_agenerate`` is LangChain's own: the whole ``_generate`` in one worker thread.


def conversation_from_config(config: RunnableConfig | None = None, run_manager: Any = None) -> str | None:
    """The conversation a call belongs to, from its run config.

    ``configurable`` ``conversation_id``, ``session_id`` (``RunnableWithMessageHistory``) or
    ``thread_id`` (LangGraph), else ``conversation_id`` in the metadata. With no ``config`` the
    config of the enclosing runnable is used (LangChain's context variable).
    """
    cfg = ensure_config(config)
    configurable = cfg.get("configurable") or {}
    meta: dict[str, Any] = {}
    if run_manager is not None:
        meta.update(getattr(run_manager, "inheritable_metadata", None) or {})
        meta.update(getattr(run_manager, "metadata", None) or {})
    meta.update(cfg.get("metadata") or {})
    for source in (configurable, meta):
        for key in CONVERSATION_KEYS:
            value = source.get(key)
            if value is not None and value != "":
                return str(value)
    return None


def with_conversation(config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus ``conversation_id`` from ``config`` (LangChain does not hand the config to ``_stream``)."""
    if kwargs.get("conversation_id") is None:
        cid = conversation_from_config(config)
        if cid is not None:
            return {**kwargs, "conversation_id": cid}
    return kwargs


def usage_metadata(generation: Generation) -> dict[str, Any]:
    """LangChain ``usage_metadata``: ``input_token_details.cache_read`` = reused prompt tokens."""
    u = usage(generation)
    return {
        "input_tokens": u["prompt_tokens"],
        "output_tokens": u["completion_tokens"],
        "total_tokens": u["total_tokens"],
        "input_token_details": {"cache_read": u["cache_read"]},
    }


def engine_pieces(
    settings: EngineSettings,
    prompt: Prompt,
    stop: list[str] | None,
    kwargs: dict[str, Any],
    run_manager: Any = None,
) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """The one chunk iterator: ``(text, None)`` per decoded piece, then ``("", info)`` once.

    ``info`` is the response metadata (:func:`kvrag.integrations._shared.call_metadata`, plus
    ``model_provider``) with ``usage_metadata``. ``prompt`` is chat messages (the chat model's;
    the engine or server renders them with the model's chat template) or a plain string. A per-call ``stop
    replaces the LLM's ``stop`` field, as every per-call argument replaces its field.
    """
    if kwargs.get("conversation_id") is None:
        kwargs = {**kwargs, "conversation_id": conversation_from_config(None, run_manager)}
    call = settings.start_call(prompt, {**kwargs, "stop": stop}, settings.call_defaults())
    with closing(call):
        for text, generation in call:
            if generation is None:
                yield text, None
            else:
                info = {**call.metadata(generation), "model_provider": "kvrag"}
                served = getattr(generation, "tool_calls", None)  # a kvrag server's (base_url=), parsed there
                extra = {"tool_calls": served} if served else {}
                yield "", {**info, "usage_metadata": usage_metadata(generation), **extra}
