"""The embedded PyTorch engine behind the :class:`Engine` facade, one folder per layer.

Dependencies point one way (``lint-imports`` checks them in ``make test``; contracts in ``pyproject.toml``):
:mod:`~kvrag.engine.serving` (the engine thread, scheduler, requests, write-back) ->
:mod:`~kvrag.engine.reuse` (planning, fusion, selection, variants, conversations) ->
:mod:`~kvrag.engine.model` (family adapters, loading, the layer runner, sampling) -> :mod:`kvrag.kernels`;
and :mod:`~kvrag.engine.reuse` -> :mod:`~kvrag.engine.store` (tiers, record format, eviction).
"""

from kvrag.engine.engine import Engine
from kvrag.engine.model.sampling import SamplingParams
from kvrag.engine.options import RequestOptions
from kvrag.engine.registry import drop_engines, get_engine
from kvrag.engine.types import (
    CacheLookup,
    ChunkInfo,
    EngineInfo,
    Generation,
    GenerationStats,
    GenerationStream,
    ScoreResult,
    WarmResult,
)

__all__ = [
    "Engine",
    "SamplingParams",
    "RequestOptions",
    "get_engine",
    "drop_engines",
    "Generation",
    "GenerationStats",
    "GenerationStream",
    "ChunkInfo",
    "EngineInfo",
    "ScoreResult",
    "WarmResult",
    "CacheLookup",
]
