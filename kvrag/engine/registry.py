"""Process-wide engines, shared by the integrations so that constructing an LLM wrapper is cheap: the
first call loads the engine of its model and settings, later ones (any LLM, retriever or node
postprocessor with the same settings) share it, and its chunk registry and KV cache."""

from __future__ import annotations

import threading

from kvrag.config import EngineConfig
from kvrag.engine.engine import Engine
from kvrag.engine.model.bundled import BUNDLED, find_bundled

__all__ = ["get_engine", "drop_engines"]

_engines: dict[EngineConfig, Engine] = {}
_engines_lock = threading.Lock()


def get_engine(model: str | None = None, **config) -> Engine:
    """The engine for this model and configuration, loaded on first use and shared afterwards.

    Args:
        model: as for :meth:`Engine.from_pretrained` (``None`` = bundled SmolLM2-135M-Instruct).
        **config: :class:`~kvrag.EngineConfig` settings by their flat names (dtype, device, ...).
    """
    bundled = find_bundled(model) if isinstance(model, str) else None
    if bundled is not None:  # any name of a bundled model: one engine per model
        model = None if bundled is BUNDLED[0] else bundled.name
    cfg = EngineConfig().replace(**config)  # an old setting's name says where it went
    cfg = cfg.replace(model=model) if model is not None else cfg
    key = cfg  # immutable, hashed and compared by value
    engine = _engines.get(key)
    if engine is not None:
        return engine
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = Engine.from_pretrained(config=cfg)
            _engines[key] = engine
        return engine


def drop_engines() -> None:
    """Close and forget every shared engine (tests, shutdown)."""
    with _engines_lock:
        for engine in _engines.values():
            engine.close()
        _engines.clear()
