"""kvrag: fast retrieval-augmented generation by reusing the KV cache of retrieved chunks."""

from importlib.metadata import PackageNotFoundError, version

from kvrag.config import ComputeSettings, Constraint, EngineConfig, ReuseSettings, ServingSettings, StoreSettings
from kvrag.engine import (
    CacheLookup,
    ChunkInfo,
    Engine,
    EngineInfo,
    Generation,
    GenerationStats,
    GenerationStream,
    RequestOptions,
    SamplingParams,
    ScoreResult,
    WarmResult,
)
from kvrag.errors import (
    ContextLengthError,
    InvalidRequestError,
    KvragError,
    ModelNotFoundError,
    OverloadedError,
    ServerError,
    StoreError,
    UnsupportedModelError,
)

try:
    __version__ = version("kvrag")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "Engine",
    "Constraint",
    "EngineConfig",
    "ComputeSettings",
    "ReuseSettings",
    "StoreSettings",
    "ServingSettings",
    "SamplingParams",
    "Generation",
    "GenerationStats",
    "GenerationStream",
    "ChunkInfo",
    "EngineInfo",
    "ScoreResult",
    "WarmResult",
    "CacheLookup",
    "RequestOptions",
    "KvragError",
    "InvalidRequestError",
    "ContextLengthError",
    "UnsupportedModelError",
    "ModelNotFoundError",
    "StoreError",
    "ServerError",
    "OverloadedError",
    "__version__",
]
