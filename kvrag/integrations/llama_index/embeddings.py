"""Offline embeddings for LlamaIndex: the bundled MiniLM through ``llama-index-embeddings-huggingface``."""

from __future__ import annotations

from typing import Any

from kvrag.integrations.minilm import minilm_dir

__all__ = ["minilm_embedding"]


def minilm_embedding(device: str = "cpu", **kwargs: Any):
    """A LlamaIndex ``HuggingFaceEmbedding`` over the bundled all-MiniLM-L6-v2 (nothing downloaded).

    Args:
        device: torch device of the embedder.
        **kwargs: other ``HuggingFaceEmbedding`` arguments (``embed_batch_size``, ...).
    """
    try:
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImportError("minilm_embedding needs `pip install 'kvrag[llama-index]'`") from exc
    return HuggingFaceEmbedding(model_name=str(minilm_dir()), device=device, **kwargs)
