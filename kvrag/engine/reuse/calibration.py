"""Per-model calibration of ``recompute_ratio="auto"``: the probe deviation from which a block is recomputed.

A probe's KV deviation has a scale of its own for every model (and probe layer, block size and
deviation kind). ``python -m benchmarks calibrate`` measures, on dev questions, the threshold that makes
``auto`` recompute what a fixed budget would in the favourable case, and writes it here:
``<cache_dir>/calibration/<model fingerprint>.json``. The bundled model's value ships with kvrag
(``kvrag/engine/reuse/data/calibration.json``), keyed the same way.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["probe_key", "load", "save"]


def probe_key(probe_layer: int, probe_stride: int, deviation: str) -> str:
    """The probe settings a threshold belongs to."""
    return f"layer={probe_layer},stride={probe_stride},deviation={deviation}"


def _read(path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _shipped() -> dict:
    try:
        text = resources.files("kvrag.engine.reuse").joinpath("data/calibration.json").read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else None


def _entry(data, probe: str) -> dict:
    entry = data.get(probe) if isinstance(data, dict) else None
    if not isinstance(entry, dict):
        return {}
    return {k: v for k in ("threshold", "alpha") if (v := _number(entry.get(k))) is not None}


def load(cache_dir: Path, fingerprint: str, probe: str) -> dict:
    """The calibrated ``threshold`` and ``alpha`` for this model and probe (either may be missing):
    the user's own (``python -m benchmarks calibrate``) first, then the one shipped with kvrag."""
    mine = _entry(_read(Path(cache_dir) / "calibration" / f"{fingerprint}.json"), probe)
    return mine or _entry(_shipped().get(fingerprint), probe)


def save(cache_dir: Path, fingerprint: str, probe: str, threshold: float, facts: dict) -> Path:
    """Record a calibrated threshold (with ``alpha`` and what they were measured on) for this model and probe."""
    path = Path(cache_dir) / "calibration" / f"{fingerprint}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path)
    data[probe] = {"threshold": float(threshold), **facts}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path
