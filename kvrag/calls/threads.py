"""Running the engine's blocking iterators off the event loop: one worker thread per stream.

The async APIs of LangChain and LlamaIndex must never block the loop: a prefill takes seconds.
A stream is opened and driven by one worker thread, which hands items to the loop through an
asyncio queue, so no token is waited for on the loop's thread and no thread hop is paid per
token. Non-streaming async calls need no bridge: the whole call runs in one worker thread
(``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, TypeVar

__all__ = ["open_in_thread"]

T = TypeVar("T")

_READY, _ITEM, _ERROR, _END = range(4)


async def open_in_thread(make: Callable[[], Iterator[T]]) -> AsyncGenerator[T, None]:
    """Call ``make`` in a new worker thread, then iterate what it returns there.

    Returns once ``make`` has returned (its errors, e.g. a request the engine rejects, are raised
    here); the async generator returned yields the iterator's items on the event loop. The worker
    runs in a copy of the caller's context (context variables carry over). When the consumer stops
    early (``aclose``, cancellation, an exception, garbage collection) the worker stops after the
    item it is computing and closes the iterator in its own thread, which for an engine stream
    frees the request.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    stop = threading.Event()

    def post(kind: int, value: Any = None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            stop.set()

    def work() -> None:
        try:
            iterator = make()
        except BaseException as exc:  # handed to the awaiting caller, raised there
            post(_ERROR, exc)
            return
        post(_READY)
        try:
            while not stop.is_set():
                try:
                    item = next(iterator)
                except StopIteration:
                    post(_END)
                    return
                post(_ITEM, item)
        except BaseException as exc:
            post(_ERROR, exc)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    async def items() -> AsyncGenerator[Any, None]:
        try:
            while True:
                kind, value = await queue.get()
                if kind == _ERROR:
                    raise value
                if kind == _END:
                    return
                yield value  # _READY first (consumed below), then the items
        finally:
            stop.set()

    ctx = contextvars.copy_context()
    threading.Thread(target=ctx.run, args=(work,), name="kvrag-stream", daemon=True).start()
    stream = items()
    await anext(stream)  # the _READY marker: make() returned, or its error is raised here
    return stream
