"""One engine call as an iterator, and what it did as the figures the integrations and the server report."""

from __future__ import annotations

from typing import Any

from kvrag.engine import Generation, GenerationStream

__all__ = ["EngineCall", "METADATA_KEYS", "call_metadata", "usage"]

#: The keys of :func:`call_metadata`: what every kvrag LLM response carries, in both integrations.
METADATA_KEYS = frozenset(
    {
        "model_name",
        "finish_reason",
        "ttft_s",
        "total_s",
        "mode",
        "path",
        "path_reason",
        "recompute_ratio",
        "prompt_tokens",
        "completion_tokens",
        "cache_read",
        "prefix_tokens",
        "exact_tokens",
        "recomputed_tokens",
        "compute_fraction",
        "chunk_hits",
        "chunk_misses",
        "chunks_found",
        "conversation_id",
        "conversation_tokens",
        "conversation_spans",
        "deduplicated_chunks",
    }
)


def call_metadata(generation: Generation, *, model_name: str | None, conversation_id: str | None) -> dict[str, Any]:
    """What a finished request did, flat: TTFT, cache read, chunk hits/misses, recompute, mode and
    the path its prefill took (``full`` where reuse could not win: see ``GenerationStats.path``).

    ``cache_read`` counts prompt tokens whose KV was reused (exact prefix, chunk hits and the
    conversation's previous turn), ``exact_tokens`` those of them reused exactly (the exact prefix
    and the knowledge tree's chunk sequences: nothing to fix there); ``conversation_spans`` are the
    prompt positions ``[a, b)`` of the ``conversation_tokens``. See :class:`~kvrag.engine.GenerationStats`.
    """
    s = generation.stats
    return {
        "model_name": model_name,
        "finish_reason": generation.finish_reason,
        "ttft_s": generation.ttft_s,
        "total_s": generation.total_s,
        "mode": s.mode,
        "path": s.path,
        "path_reason": s.path_reason,
        "recompute_ratio": s.recompute_ratio,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "cache_read": s.cached_tokens,
        "prefix_tokens": s.prefix_tokens,
        "exact_tokens": s.exact_tokens,
        "recomputed_tokens": s.recomputed_tokens,
        "compute_fraction": s.compute_fraction,
        "chunk_hits": s.chunk_hits,
        "chunk_misses": s.chunk_misses,
        "chunks_found": s.chunks_found,
        "conversation_id": conversation_id,
        "conversation_tokens": s.conversation_tokens,
        "conversation_spans": [list(span) for span in s.conversation_spans],
        "deduplicated_chunks": s.deduplicated_chunks,
    }


def usage(generation: Generation) -> dict[str, int]:
    """Token counts: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``, ``cache_read``."""
    s = generation.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "cache_read": s.cached_tokens,
    }


class EngineCall:
    """One engine request as the iterator every call path reads.

    Yields ``(piece, None)`` per decoded text piece, then ``("", generation)`` once. :meth:`close`
    stops the generation and frees the request, whether or not iteration has started.

    Args:
        stream: the engine's stream (already validated).
        model_name: the model named in the response metadata.
        conversation_id: the conversation the call belongs to, if any.
    """

    def __init__(self, stream: GenerationStream, *, model_name: str, conversation_id: str | None) -> None:
        self._stream = stream
        self._done = False
        self.model_name = model_name
        self.conversation_id = conversation_id

    def __iter__(self) -> EngineCall:
        return self

    def __next__(self) -> tuple[str, Generation | None]:
        if self._done:
            raise StopIteration
        try:
            return next(self._stream), None
        except StopIteration:
            self._done = True
            if self._stream.generation is None:  # closed from another thread while it waited
                raise
            return "", self._stream.generation
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop generating; frees the request's KV (a no-op once finished)."""
        self._done = True
        self._stream.close()

    def finish(self) -> Generation:
        """Run the call to its end and return the result."""
        for _, generation in self:
            if generation is not None:
                return generation
        raise RuntimeError("the engine call was closed before it finished")

    def metadata(self, generation: Generation) -> dict[str, Any]:
        """:func:`call_metadata` of this call's result."""
        return call_metadata(generation, model_name=self.model_name, conversation_id=self.conversation_id)
