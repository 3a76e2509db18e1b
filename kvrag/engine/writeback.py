"""Write-back off the critical path: what a request computed is stored after its first token.

Two kinds of entries: exact-prefix blocks (the system prompt and instructions every request
repeats) and the KV of chunks a request missed — taken from the request's own prefill when the
chunk context is ``neighbor`` (captured in place, no extra compute), computed alone otherwise.
What needs torch compute (a chunk computed alone, Cache-Craft's attention statistics over the
request's queries and KV) runs on the engine thread, queued like other work. Jobs run in one
daemon thread, in order; a failed job costs only a future hit.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from kvrag.engine.attention_stats import Segment
from kvrag.engine.chunks import ChunkComputer, attach_statistics
from kvrag.engine.planner import Plan, Planner
from kvrag.engine.runner import KVCapture
from kvrag.engine.store.base import KVRecord, KVStore
from kvrag.engine.variants import context_id

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
        if not self.keeps(plan):
            return []
        return [u for u in plan.chunks if not u.hit and u.length >= self.config.chunk_min_tokens]

    def keeps(self, plan: Plan) -> bool:
        """Whether what this request computes of its chunks is kept (write-back, a mode that reuses)."""
        return self.config.write_back and plan.mode in ("blend", "reuse")

    def keeps_recomputed(self, plan: Plan) -> bool:
        """Whether cached chunks the request recomputes whole are kept as new variants (neighbor context)."""
        return self.keeps(plan) and self.computer.context == "neighbor" and self.config.max_variants > 1

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
        exact_end = plan.exact_end()
        segments = [Segment(u.start, u.start + u.length, context_id(plan.segments[u.index].ids)) for u in plan.chunks]
        kept = {u.index for u in self._kept_misses(plan)} | {i for i in res.chunk_captures if self.keeps(plan)}
        for n, use in enumerate(plan.chunks):
            if use.index not in kept:
                continue
            cap = res.chunk_captures.get(use.index)
            # a chunk computed here is a variant computed behind this prompt's chunks; exact if it
            # was missed and everything before it was exact (the knowledge tree's path)
            context = use.context if cap is not None else ()
            exact = use.digest if cap is not None and not use.hit and use.start + use.length <= exact_end else None
            job = (use.key, context, exact)
            if job in self._pending:
                continue
            self._pending.add(job)
            ids = list(plan.segments[use.index].ids)
            tap = res.taps.get(use.index)
            measured = (tap, res.buf, segments[:n]) if tap is not None else None
            self._writer.submit(
                lambda job=job, ids=ids, cap=cap, measured=measured: self._write_chunk(job, ids, cap, measured)
            )

    def _write_chunk(self, job, ids: list[int], capture: KVCapture | None, measured=None) -> None:
        key, context, exact = job
        try:
            if capture is None and self.store.contains(key):
                return
            if capture is None or measured is not None:  # model compute: on the engine thread
                record = self._run(lambda pause: self._record(ids, capture, measured, pause), len(ids))
            else:
                record = self._record(ids, capture, None, None)
            self.planner.keep_variant(key, record, context, exact)
        finally:
            self._pending.discard(job)

    def _record(self, ids: list[int], capture: KVCapture | None, measured, pause) -> KVRecord:
        """A missed chunk's record: from the request's capture (with Cache-Craft's statistics from its
        own queries and KV, when measured), or computed alone behind its context."""
        if capture is None:
            return self.computer.compute(ids, pause=pause)
        record = self.computer.record_from_capture(ids, capture)
        if measured is not None:
            tap, buf, segments = measured
            attach_statistics(record, tap, buf, (capture.start, capture.end), segments, self.computer.adapter)
        return record

    def flush(self) -> None:
        """Wait until every scheduled job has run."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
