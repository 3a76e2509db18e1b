"""The reuse layer: what to reuse and how (planner, variants, prefix cache, fusion and KV placement,
selection strategies, conversations, the prompt's document finder, calibration, the gate).

Imports :mod:`~kvrag.engine.model` and :mod:`~kvrag.engine.store`, never :mod:`~kvrag.engine.serving`."""
