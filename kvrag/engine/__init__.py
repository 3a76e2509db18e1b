"""The embedded PyTorch engine behind the :class:`Engine` facade, one folder per layer.

Dependencies point one way (checked in ``make test``, ``tests/test_layers.py``):
:mod:`~kvrag.engine.serving` (the engine thread, scheduler, requests, write-back) ->
:mod:`~kvrag.engine.reuse` (planning, fusion, selection, variants, conversations) ->
:mod:`~kvrag.engine.model` (family adapters, loading, the layer runner, sampling) -> :mod:`kvrag.kernels`;
and :mod:`~kvrag.engine.reuse` -> :mod:`~kvrag.engine.store` (tiers, record format, eviction).
"""

from kvrag.engine.engine import Engine, drop_engines, get_engine
from kvrag.engine.model.sampling import SamplingParams
from kvrag.engine.reuse.calibration import CalibrationQuestion, CalibrationResult, QualityCalibration
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
    "CalibrationQuestion",
    "CalibrationResult",
    "QualityCalibration",
]
