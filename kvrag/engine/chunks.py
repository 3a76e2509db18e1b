"""Computing chunk KV for the store.

Where a chunk's KV is computed matters. CacheBlend computes each chunk alone behind the
attention-sink token. On the bundled SmolLM2-135M that KV is far from what the chunk gets inside
a real prompt, and a small recompute budget cannot close the gap; the same chunk computed behind
another document (its KV kept, the document's dropped) is much closer (README, "Fidelity"). So by
default (``chunk_context="neighbor"``):

- ``warm(chunks)`` computes each chunk behind its neighbour in the list (the first behind the last;
  a lone chunk behind the previous document this engine computed, or a built-in passage);
- a chunk a request missed is kept with the KV the request computed for it, in its real context,
  at no extra cost (captured during the prefill).

``chunk_context="sink"`` restores CacheBlend's behaviour. Keys carry the context kind, so caches
computed both ways never mix. Keys are stored without RoPE, so the context's length does not
matter when the chunk is placed elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib import resources

import torch

from kvrag.config import CHUNK_CONTEXTS
from kvrag.engine.model import ModelAdapter
from kvrag.engine.runner import KVBuffer, KVCapture, forward
from kvrag.engine.store.base import KVRecord

log = logging.getLogger(__name__)

__all__ = ["CHUNK_CONTEXTS", "ChunkComputer", "context_label"]

#: Most context tokens kept behind a chunk (the tail of the neighbouring document).
MAX_CONTEXT_TOKENS = 512


def context_label(context: str, sink_ids: list[int]) -> str:
    """The context kind in every chunk key, so records computed differently never mix."""
    return "doc-v1" if context == "neighbor" else "sink:" + ",".join(map(str, sink_ids))


class ChunkComputer:
    """Computes the KV records of chunks, behind the configured kind of context.

    Args:
        adapter: the model.
        tokenize: text -> token ids (no special tokens).
        sink_ids: the attention-sink token(s) every context starts with.
        context: one of :data:`CHUNK_CONTEXTS`.
    """

    def __init__(self, adapter: ModelAdapter, tokenize: Callable[[str], list[int]], sink_ids: list[int], context: str):
        if context not in CHUNK_CONTEXTS:
            raise ValueError(f"chunk_context must be one of {CHUNK_CONTEXTS}, got {context!r}")
        self.adapter = adapter
        self.tokenize = tokenize
        self.sink_ids = list(sink_ids)
        self.context = context
        self.label = context_label(context, sink_ids)
        self._last_doc: list[int] | None = None
        self._builtin: list[int] | None = None

    def _builtin_doc(self) -> list[int]:
        if self._builtin is None:
            text = resources.files("kvrag.engine").joinpath("data/context.txt").read_text(encoding="utf-8")
            self._builtin = self.tokenize(text)
        return self._builtin

    def context_ids(self, neighbor: list[int] | None) -> list[int]:
        """Tokens a chunk is computed behind (their KV is dropped)."""
        if self.context == "sink":
            return list(self.sink_ids)
        doc = neighbor or self._last_doc or self._builtin_doc()
        return self.sink_ids + list(doc[-MAX_CONTEXT_TOKENS:])

    def max_chunk_tokens(self, window: int) -> int:
        """Longest chunk that fits the context window behind its context."""
        extra = len(self.sink_ids) + (0 if self.context == "sink" else MAX_CONTEXT_TOKENS)
        return window - extra - 1

    def compute(self, ids: list[int], neighbor: list[int] | None = None) -> KVRecord:
        """KV record of a chunk computed behind its context (call under the engine's lock)."""
        ctx = self.context_ids(neighbor)
        s = len(ctx)
        full = torch.tensor(ctx + list(ids), dtype=torch.long)
        n = int(full.shape[0])
        buf = KVBuffer(self.adapter, n)
        cap = KVCapture(self.adapter, s, n)
        forward(self.adapter, buf, full, torch.arange(n), n, capture=[cap])
        self._last_doc = list(ids)
        return KVRecord(torch.tensor(ids), cap.k, cap.v, kind="chunk", context=self.label)

    def record_from_capture(self, ids: list[int], capture: KVCapture) -> KVRecord:
        """A chunk's record from the KV a request computed for it in its real context."""
        self._last_doc = list(ids)
        return KVRecord(torch.tensor(ids), capture.k, capture.v, kind="chunk", context=self.label,
                        meta={"computed": "in-request"})
