"""The serving layer: the engine thread, the scheduler, running sequences, requests, write-back
and the idle-time refresh, cost feedback, progress.

Imports :mod:`~kvrag.engine.reuse` and below."""
