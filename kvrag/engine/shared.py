"""Process-wide engines, shared by integrations so that constructing an LLM wrapper is cheap."""

from __future__ import annotations

import threading

from kvrag.config import EngineConfig
from kvrag.engine.bundled import BUNDLED, find_bundled
from kvrag.engine.engine import Engine

__all__ = ["get_engine", "drop_engines"]

_engines: dict[tuple, Engine] = {}
_lock = threading.Lock()


def _key(config: EngineConfig) -> tuple:
    fields = []
    for name in config.__slots__:
        value = getattr(config, name)
        fields.append((name, repr(value)))
    return tuple(fields)


def get_engine(model: str | None = None, **config) -> Engine:
    """The engine for this model and configuration, loaded on first use and shared afterwards.

    Args:
        model: as for :meth:`Engine.from_pretrained` (``None`` = bundled SmolLM2-135M-Instruct).
        **config: :class:`EngineConfig` fields (dtype, device, recompute_ratio, ...).
    """
    bundled = find_bundled(model) if isinstance(model, str) else None
    if bundled is not None:  # any name of a bundled model: one engine per model
        model = None if bundled is BUNDLED[0] else bundled.name
    cfg = EngineConfig(**config).replace(model=model) if model is not None else EngineConfig(**config)
    key = _key(cfg)
    engine = _engines.get(key)
    if engine is not None:
        return engine
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = Engine.from_pretrained(config=cfg)
            _engines[key] = engine
        return engine


def drop_engines() -> None:
    """Close and forget every shared engine (tests, shutdown)."""
    with _lock:
        for engine in _engines.values():
            engine.close()
        _engines.clear()
