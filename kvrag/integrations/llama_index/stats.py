"""Collecting kvrag's per-call figures from LlamaIndex pipelines.

Query and chat engines return a ``Response`` that no longer carries the LLM's own response, so
the figures (TTFT, cache read, chunk hits/misses, recomputed tokens) are picked up from
LlamaIndex's instrumentation events, the way ``TokenCountingHandler`` picks up token counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent

from kvrag.integrations._shared import METADATA_KEYS

__all__ = ["KVStatsHandler", "record_stats"]


class KVStatsHandler(BaseEventHandler):
    """Keeps ``additional_kwargs`` of every finished ``KVCachedLLM`` call, in order.

    Attach with ``llama_index.core.instrumentation.get_dispatcher().add_event_handler(handler)``
    or use :func:`record_stats`. Each record is the dict ``KVCachedLLM`` puts into a response's
    ``additional_kwargs`` (``ttft_s``, ``cache_read``, ``chunk_hits``, ...: the keys of
    :data:`kvrag.integrations._shared.METADATA_KEYS`).
    """

    records: list[dict] = []

    @classmethod
    def class_name(cls) -> str:
        return "KVStatsHandler"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response is not None:
            info = event.response.additional_kwargs
            if METADATA_KEYS <= info.keys():  # a kvrag response, not another LLM's
                self.records.append(dict(info))


@contextmanager
def record_stats() -> Iterator[list[dict]]:
    """Collect the figures of every ``KVCachedLLM`` call made inside the block (any thread).

    Example:
        >>> with record_stats() as calls:
        ...     query_engine.query("...")
        >>> calls[-1]["ttft_s"], calls[-1]["chunk_hits"]
    """
    handler = KVStatsHandler(records=[])
    root = get_dispatcher()
    root.add_event_handler(handler)
    try:
        yield handler.records
    finally:
        root.event_handlers = [h for h in root.event_handlers if h is not handler]
