"""Running the engine's blocking calls off the event loop.

LlamaIndex's async API must never block the loop: a prefill takes seconds. Single calls go through
``asyncio.to_thread``; streams are driven by one worker thread that hands pieces to the loop, so
a token is never waited for on the loop's thread, and an abandoned stream stops the generation.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

__all__ = ["aiter_in_thread"]

T = TypeVar("T")

_ITEM, _ERROR, _END = 0, 1, 2


async def aiter_in_thread(iterator: Iterator[T]) -> AsyncIterator[T]:
    """Iterate a blocking iterator in a worker thread, yielding its items on the event loop.

    The worker runs in a copy of the caller's context (context variables carry over). When the
    consumer stops early (break, cancellation, garbage collection) the worker is told to stop and
    closes the iterator after the item it is computing.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def post(kind: int, value) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            stop.set()

    def work() -> None:
        try:
            for item in iterator:
                if stop.is_set():
                    break
                post(_ITEM, item)
        except BaseException as exc:  # handed to the consumer, raised there
            post(_ERROR, exc)
        else:
            post(_END, None)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    ctx = contextvars.copy_context()
    threading.Thread(target=ctx.run, args=(work,), name="kvrag-llama-index-stream", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == _ITEM:
                yield value
            elif kind == _ERROR:
                raise value
            else:
                return
    finally:
        stop.set()
