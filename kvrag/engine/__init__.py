"""The embedded PyTorch engine: model adapter, layer runner, fusion, store, planner."""

from kvrag.engine.engine import Engine
from kvrag.engine.sampling import SamplingParams
from kvrag.engine.shared import drop_engines, get_engine
from kvrag.engine.types import (
    CacheLookup,
    ChunkInfo,
    Generation,
    GenerationStats,
    GenerationStream,
    ScoreResult,
    WarmResult,
)

__all__ = [
    "Engine",
    "SamplingParams",
    "get_engine",
    "drop_engines",
    "Generation",
    "GenerationStats",
    "GenerationStream",
    "ChunkInfo",
    "ScoreResult",
    "WarmResult",
    "CacheLookup",
]
