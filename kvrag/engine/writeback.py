"""Write-back off the critical path: what a request computed is stored after its first token.

Two kinds of entries: exact-prefix blocks (the system prompt and instructions every request
repeats) and the KV of chunks a request missed — taken from the request's own prefill when the
chunk context is ``neighbor`` (captured in place, no extra compute), computed alone otherwise
(that computation runs on the engine thread, queued like other work). Jobs run in one daemon
thread, in order; a failed job costs only a future hit.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from kvrag.engine.chunks import ChunkComputer
from kvrag.engine.planner import Plan, Planner
from kvrag.engine.runner import KVCapture
from kvrag.engine.store.base import KVStore

log = logging.getLogger(__name__)

__all__ = ["BackgroundWriter", "WriteBack"]


class BackgroundWriter:
    """Runs write-back jobs in a daemon thread, in submission order.

    The thread exits as soon as the queue is empty and a new one starts with the next job: a
    thread that has run torch ops and stays alive, even idle, slowed the next prefills on the
    request thread by ~20% here (2 cores); one that has exited does not. So no worker outlives
    its work.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _thread against a job stranded by an exiting worker

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._queue.put(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kvrag-writeback", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    self._thread = None
                    return
            try:
                job()
            except Exception:  # a failed write-back only costs a future hit
                log.warning("kvrag: write-back failed", exc_info=True)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every submitted job has run (and the worker that ran them has exited)."""
        self._queue.join()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    def close(self) -> None:
        self.flush()


class WriteBack:
    """Schedules a request's write-back jobs on a :class:`BackgroundWriter`.

    Args:
        config: the engine's config (``write_back``: keep the KV of missed chunks; chunks shorter than
            ``chunk_min_tokens`` are not kept).
        run: ``run(job, tokens)`` calls ``job(pause)`` on the engine thread and returns its result
            (for a chunk that has to be computed afresh).
    """

    def __init__(
        self, config, store: KVStore, planner: Planner, computer: ChunkComputer, *, run: Callable[[Callable, int], Any]
    ) -> None:
        self.config, self.store, self.planner, self.computer, self._run = config, store, planner, computer, run
        self._writer = BackgroundWriter()
        self._pending: set = set()

    def _kept_misses(self, plan: Plan) -> list:
        """The plan's missed chunks whose KV is worth keeping."""
        if not self.config.write_back or plan.mode not in ("blend", "reuse"):
            return []
        return [u for u in plan.chunks if not u.hit and u.length >= self.config.chunk_min_tokens]

    def captures(self, plan: Plan) -> tuple[int, ...]:
        """Segments of missed chunks whose KV the request computes and can keep (neighbor context)."""
        if self.computer.context != "neighbor":
            return ()
        return tuple(u.index for u in self._kept_misses(plan))

    def schedule(self, plan: Plan, res) -> None:
        """After the first token: keep the exact prefix blocks and the KV of chunks seen first."""
        capture = res.capture
        if capture is not None:
            prompt_ids, bounds, namespace = plan.ids.tolist(), plan.boundaries, plan.namespace
            self._writer.submit(
                lambda: self.planner.prefix_cache.insert(
                    prompt_ids, capture.k, capture.v, capture.start, capture.end, bounds, namespace=namespace
                )
            )
        for use in self._kept_misses(plan):
            if use.key in self._pending:
                continue
            self._pending.add(use.key)
            ids, cap = list(plan.segments[use.index].ids), res.chunk_captures.get(use.index)
            self._writer.submit(lambda key=use.key, ids=ids, cap=cap: self._write_chunk(key, ids, cap))

    def _write_chunk(self, key, ids: list[int], capture: KVCapture | None) -> None:
        try:
            if self.store.contains(key):
                return
            if capture is not None:
                record = self.computer.record_from_capture(ids, capture)
            else:
                record = self._run(lambda pause: self.computer.compute(ids, pause=pause), len(ids))
            if not self.store.contains(key):
                self.store.put(key, record)
        finally:
            self._pending.discard(key)

    def flush(self) -> None:
        """Wait until every scheduled job has run."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
