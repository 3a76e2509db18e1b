"""Shared pieces of the LlamaIndex tests: an instant embedding and the no-OpenAI guard."""

from __future__ import annotations

import hashlib

import pytest
from llama_index.core.base.embeddings.base import BaseEmbedding

__all__ = ["BowEmbedding", "no_default_models"]


class BowEmbedding(BaseEmbedding):
    """Hashed bag of words: deterministic, instant, and retrieval still follows word overlap."""

    def _vec(self, text: str) -> list[float]:
        v = [0.0] * 64
        for w in text.lower().split():
            v[int(hashlib.md5(w.encode()).hexdigest(), 16) % 64] += 1.0
        norm = sum(x * x for x in v) ** 0.5 or 1.0
        return [x / norm for x in v]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vec(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)


@pytest.fixture(autouse=True)
def no_default_models(monkeypatch):
    """Fail any test in which LlamaIndex falls back to its default (OpenAI) LLM or embedding."""
    import llama_index.core.settings as settings_mod
    from llama_index.core import Settings

    def refuse(*args, **kwargs):
        raise AssertionError("LlamaIndex tried to resolve a default model (OpenAI); pass llm= and embed_model=")

    monkeypatch.setattr(settings_mod, "resolve_llm", refuse)
    monkeypatch.setattr(settings_mod, "resolve_embed_model", refuse)
    monkeypatch.setattr(Settings, "_llm", None)
    monkeypatch.setattr(Settings, "_embed_model", None)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-be-used")
