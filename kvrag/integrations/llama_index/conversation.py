"""Conversation identity for LlamaIndex calls that cannot carry one.

A LlamaIndex chat engine calls the LLM without any per-conversation argument, so the identity
comes from the LLM (``KVCachedLLM(conversation_id=...)``) or from the surrounding code::

    with conversation("user-42"):
        chat_engine.chat("...")

The identity is a context variable: it follows asyncio tasks and the worker threads kvrag starts,
and concurrent conversations in different tasks or threads do not see each other's.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from kvrag.errors import InvalidRequestError

__all__ = ["conversation", "current_conversation"]

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvrag_llama_index_conversation", default=None)


@contextmanager
def conversation(conversation_id: str) -> Iterator[str]:
    """Make every ``KVCachedLLM`` call inside the block part of this conversation."""
    if not isinstance(conversation_id, str) or not conversation_id:
        raise InvalidRequestError("conversation_id must be a non-empty string")
    token = _current.set(conversation_id)
    try:
        yield conversation_id
    finally:
        _current.reset(token)


def current_conversation() -> str | None:
    """The conversation set by the innermost :func:`conversation` block, if any."""
    return _current.get()
