"""What the LangChain chat model and text LLM share: settings, the chunk iterator, metadata.

One iterator, :func:`engine_pieces`, drives every call path: sync and async, streaming and not.
Async paths run it in worker threads (:func:`iterate_in_thread`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

from langchain_core.runnables.config import RunnableConfig, ensure_config
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvrag.config import EngineConfig, check_ratio
from kvrag.engine import Engine, Generation, get_engine
from kvrag.errors import InvalidRequestError

__all__ = ["EngineSettings", "conversation_from_config", "engine_pieces", "iterate_in_thread", "usage", "metadata"]

#: Keys looked up, in order, in a run config's ``configurable`` and then ``metadata``.
CONVERSATION_KEYS = ("conversation_id", "session_id", "thread_id")

#: Per-call keyword arguments (``llm.invoke(x, temperature=0.2)``, ``llm.bind(...)``).
CALL_KWARGS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "mode",
        "recompute_ratio",
        "selection",
        "dedup",
        "conversation_id",
        "model",
    }
)

# Request settings are fields of the LLM and per-call arguments; in ``engine_config`` they would
# create a separate engine (another copy of the model) per value.
_PER_CALL_FIELDS = {"mode", "recompute_ratio", "selection", "max_new_tokens", "temperature", "top_p", "seed", "model"}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - _PER_CALL_FIELDS

Mode = Literal["full", "prefix", "blend", "reuse"]
Selection = Literal["hkvd", "probe", "recency"]


class EngineSettings(BaseModel):
    """Fields shared by :class:`KVCachedLLM` and :class:`KVCachedTextLLM`.

    The engine is not loaded when the LLM is constructed: the first call takes it from the
    process-wide registry (:func:`kvrag.engine.get_engine`), keyed by model and ``engine_config``,
    so every LLM, retriever and vector-store wrapper with the same settings shares one engine
    (and one chunk registry and KV cache).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    model: str | None = None
    """``None`` for the bundled SmolLM2-135M-Instruct, else a local HF model directory or ``.gguf`` file."""
    engine: Engine | None = Field(default=None, exclude=True)
    """An engine to use instead of the shared one (tests, custom stores)."""
    engine_config: dict[str, Any] = Field(default_factory=dict)
    """:class:`~kvrag.EngineConfig` fields of the shared engine (dtype, device, memory_budget_bytes, ...)."""
    mode: Mode | None = None
    """Prefill mode; ``None`` = the engine's default (``blend``). ``full`` is the no-reuse baseline."""
    recompute_ratio: float | None = None
    """Share of cached chunk tokens recomputed in ``blend`` (0..1); ``None`` = engine default."""
    selection: Selection | None = None
    """Which cached tokens ``blend`` recomputes (``hkvd`` or ``recency``); ``None`` = engine default."""
    max_tokens: int | None = None
    """Most tokens to generate; ``None`` = engine default."""
    temperature: float | None = None
    """0 = greedy; ``None`` = engine default (greedy)."""
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    """Stop strings; the output is cut before the first one."""
    dedup: bool | None = None
    """Conversation-scoped chunk deduplication; ``None`` = engine default (on)."""
    streaming: bool = False
    """Stream internally even for ``invoke`` (token callbacks)."""

    @field_validator("engine_config")
    @classmethod
    def _check_engine_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        per_call = sorted(set(value) & _PER_CALL_FIELDS)
        if per_call:
            raise ValueError(f"pass {', '.join(per_call)} as LLM fields or per-call arguments, not in engine_config")
        unknown = sorted(set(value) - _ENGINE_FIELDS)
        if unknown:
            raise ValueError(f"unknown engine_config field(s): {', '.join(unknown)}")
        EngineConfig(**value)  # validates values (cheap: no model is loaded)
        return value

    @field_validator("recompute_ratio")
    @classmethod
    def _check_ratio(cls, value: float | None) -> float | None:
        return None if value is None else check_ratio(value)

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError("max_tokens must be >= 0")
        return value

    def get_engine(self, model: str | None = None) -> Engine:
        """The engine serving this LLM (``model`` overrides the configured one for a call)."""
        if self.engine is not None and (model is None or model == self.model):
            return self.engine
        return get_engine(model if model is not None else self.model, **self.engine_config)

    def model_label(self, model: str | None = None) -> str:
        if model is not None:
            return model
        if self.model is not None:
            return self.model
        return self.engine.model_name if self.engine is not None else "SmolLM2-135M-Instruct"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model_label(), "mode": self.mode, "recompute_ratio": self.recompute_ratio}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        """LangSmith's tracing parameters: provider ``kvrag``, the model's name."""
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvrag"
        params["ls_model_name"] = self.model_label(kwargs.get("model"))
        return params

    def request_kwargs(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Engine ``stream()`` arguments of one call: fields, overridden by per-call arguments."""
        unknown = sorted(set(kwargs) - CALL_KWARGS)
        if unknown:
            raise InvalidRequestError(
                f"unknown argument(s) {', '.join(unknown)}; kvrag LLMs take {', '.join(sorted(CALL_KWARGS))}"
            )
        get = lambda name: kwargs[name] if kwargs.get(name) is not None else getattr(self, name)  # noqa: E731
        stops = list(self.stop or []) + list(stop or [])
        return {
            "max_new_tokens": get("max_tokens"),
            "temperature": get("temperature"),
            "top_p": get("top_p"),
            "seed": get("seed"),
            "mode": get("mode"),
            "recompute_ratio": get("recompute_ratio"),
            "selection": get("selection"),
            "dedup": get("dedup"),
            "stop": stops or None,
            "conversation_id": kwargs.get("conversation_id"),
        }

    def ls_fields(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {"model": kwargs.get("model"), "temperature": kwargs.get("temperature", self.temperature)}

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


def engine_pieces(
    settings: EngineSettings,
    render: Callable[[Engine], str],
    stop: list[str] | None,
    kwargs: dict[str, Any],
    run_manager: Any = None,
) -> Iterator[tuple[str, Generation | None]]:
    """The one chunk iterator: ``(text, None)`` per decoded piece, then ``("", generation)``.

    ``render`` turns the engine into the prompt string (the chat model applies the engine's chat
    template there). The engine request is validated before the first piece.
    """
    if kwargs.get("conversation_id") is None:
        cid = conversation_from_config(None, run_manager)
        if cid is not None:
            kwargs = {**kwargs, "conversation_id": cid}
    request = settings.request_kwargs(stop, kwargs)
    engine = settings.get_engine(kwargs.get("model"))
    stream = engine.stream(prompt=render(engine), **request)
    try:
        for piece in stream:
            yield piece, None
    finally:
        stream.close()
    assert stream.generation is not None
    yield "", stream.generation


async def iterate_in_thread(make: Callable[[], Iterator]) -> AsyncIterator:
    """Drive a blocking iterator from worker threads: creation and every step run off the event loop."""
    done = object()
    it = await asyncio.to_thread(make)
    try:
        while True:
            item = await asyncio.to_thread(next, it, done)
            if item is done:
                return
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


def usage(generation: Generation) -> dict[str, Any]:
    """LangChain ``usage_metadata``: ``input_token_details.cache_read`` = reused prompt tokens."""
    s = generation.stats
    return {
        "input_tokens": s.prompt_tokens,
        "output_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "input_token_details": {"cache_read": s.cached_tokens},
    }


def metadata(generation: Generation, model_name: str, conversation_id: str | None) -> dict[str, Any]:
    """``response_metadata``: what the request did (TTFT, chunk hits/misses, recompute, mode)."""
    s = generation.stats
    return {
        "model_name": model_name,
        "model_provider": "kvrag",
        "finish_reason": generation.finish_reason,
        "ttft_s": generation.ttft_s,
        "total_s": generation.total_s,
        "mode": s.mode,
        "recompute_ratio": s.recompute_ratio,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "prefix_tokens": s.prefix_tokens,
        "recomputed_tokens": s.recomputed_tokens,
        "compute_fraction": s.compute_fraction,
        "chunk_hits": s.chunk_hits,
        "chunk_misses": s.chunk_misses,
        "conversation_id": conversation_id,
        "conversation_tokens": s.conversation_tokens,
        "conversation_spans": [list(span) for span in s.conversation_spans],
        "deduplicated_chunks": s.deduplicated_chunks,
    }
