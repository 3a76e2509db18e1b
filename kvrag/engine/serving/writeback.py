"""Write-back off the critical path: what a request computed is stored after its first token.

Two kinds of entries: exact-prefix blocks (the system prompt and instructions every request
repeats) and the KV of chunks a request missed — taken from the request's own prefill when the
chunk context is ``neighbor`` (captured in place, no extra compute), computed alone otherwise.
What needs torch compute (a chunk computed alone, Cache-Craft's attention statistics over the
request's queries and KV) runs on the engine thread, queued like other work. Jobs run in one
daemon thread, in order; a failed job costs only a future hit.

A third kind, the knowledge tree's refresh (``tree_refresh``): a request that blended chunk KV
computed in another context leaves its chunk sequence to be computed exactly, as background work
on the engine thread (it starts only when the engine is idle and gives way to the next request,
:mod:`kvrag.engine.serving.scheduler`); each of those chunks is kept as an exact variant, so the same lead
and chunks asked again (reworded, or by another user) are reused exactly. Those variants are kept
``speculative``: a bounded store takes them only into room that no request's entry holds and
evicts them first until a request uses one, so refreshing never costs the hit rate of what
requests keep. At most
:data:`MAX_REFRESHES` wait at once; past that a new one is dropped (counted), never queued without
bound.

**Bounded.** The jobs waiting in the background thread's queue are at most
:data:`MAX_QUEUED_JOBS` and hold at most :data:`MAX_QUEUED_BYTES` of KV: past either, a new job is
dropped and counted (``WriteBack.stats()["dropped"]``); the request's answer is unaffected, a
dropped job costs only a future hit. A job holds only the KV it stores (the chunk's, the prefix
blocks', the tail's captures); a chunk measured for Cache-Craft's statistics holds, with the
request's other measured chunks, one copy of the keys up to its last sampled query, not the
request's KV buffer.

CRAFT's promotion gates the refresh (``promoted``, from the engine's chunk-access table,
:mod:`kvrag.engine.reuse.access`): a sequence is refreshed only for its leading chunks whose
access counts reach ``promotion_threshold``, so exact sequences are kept of what recurs. And
the table learns which chunk sequences are kept exactly (``stored``: a request's leading run of
chunks kept or reused exactly, a refreshed sequence once kept), so the frequency order can follow
them; it is told when KV is kept, not when the store evicts it (a stale path only costs a worse
order).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvrag.engine.model.runner import KVCapture
from kvrag.engine.reuse.attention_stats import ContextSpan
from kvrag.engine.reuse.chunks import ChunkComputer, attach_statistics
from kvrag.engine.reuse.fusion import PrefillOptions, prefill
from kvrag.engine.reuse.planner import ChunkUse, Plan, Planner
from kvrag.engine.reuse.variants import StoredVariants, context_id
from kvrag.engine.serving.scheduler import Ticket
from kvrag.engine.serving.worker import Preempted, Worker
from kvrag.engine.store.base import KVRecord, KVStore

log = logging.getLogger(__name__)

__all__ = ["BackgroundWriter", "WriteBack", "MAX_REFRESHES", "MAX_REFRESH_TRIES", "MAX_QUEUED_JOBS", "MAX_QUEUED_BYTES"]

#: Most write-back jobs waiting at once (one more is dropped and counted).
MAX_QUEUED_JOBS = 256
#: Most bytes of KV the waiting write-back jobs hold at once (one more is dropped and counted): 512 MiB.
MAX_QUEUED_BYTES = 512 * 1024**2

#: Most knowledge-tree refreshes waiting for an idle engine at once (one more is dropped).
MAX_REFRESHES = 4

#: Times a refresh starts over after giving way to other work before it is dropped.
MAX_REFRESH_TRIES = 3


class BackgroundWriter:
    """Runs write-back jobs in a daemon thread, in submission order; bounded (jobs and bytes held).

    Args:
        max_jobs: most jobs waiting at once (default :data:`MAX_QUEUED_JOBS`); a job past it is
            dropped (:meth:`submit` says so).
        max_bytes: most bytes the waiting jobs hold (each job's ``nbytes``; default
            :data:`MAX_QUEUED_BYTES`); past it, dropped too
            (a job larger than that alone is taken only into an empty queue).

    The thread exits as soon as the queue is empty and a new one starts with the next job: a
    thread that has run torch ops and stays alive, even idle, slowed the next prefills on the
    request thread by ~20% here (2 cores); one that has exited does not. So no worker outlives
    its work.
    """

    def __init__(self, max_jobs: int | None = None, max_bytes: int | None = None) -> None:
        self.max_jobs = MAX_QUEUED_JOBS if max_jobs is None else max_jobs
        self.max_bytes = MAX_QUEUED_BYTES if max_bytes is None else max_bytes
        self._queue: queue.Queue[tuple[Callable[[], None], int]] = queue.Queue()
        self._waiting = 0  # jobs submitted and not finished (under _lock)
        self._bytes = 0  # bytes those jobs hold
        self.dropped = 0  # jobs refused: the queue was full
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _thread against a job stranded by an exiting worker
        self._started: list[threading.Thread] = []  # workers flush() joins (one may be ending as the next starts)

    def submit(self, job: Callable[[], None], nbytes: int = 0) -> bool:
        """Queue ``job``, holding ``nbytes`` of KV until it ran; False (dropped, counted) past a bound."""
        with self._lock:
            if self._waiting >= self.max_jobs or (self._waiting and self._bytes + nbytes > self.max_bytes):
                self.dropped += 1
                return False
            self._waiting += 1
            self._bytes += nbytes
            self._queue.put((job, nbytes))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kvrag-writeback", daemon=True)
                self._started = [t for t in self._started if t.is_alive()] + [self._thread]
                self._thread.start()
        return True

    def stats(self) -> dict:
        """``queued`` jobs (waiting or running), the ``queued_bytes`` they hold, ``dropped`` jobs so
        far, and the bounds ``max_jobs``, ``max_bytes``."""
        with self._lock:
            return {
                "queued": self._waiting,
                "queued_bytes": self._bytes,
                "dropped": self.dropped,
                "max_jobs": self.max_jobs,
                "max_bytes": self.max_bytes,
            }

    def _loop(self) -> None:
        while True:
            with self._lock:
                try:
                    job, nbytes = self._queue.get_nowait()
                except queue.Empty:
                    self._thread = None
                    return
            try:
                job()
            except Exception:  # a failed write-back only costs a future hit
                log.warning("kvrag: write-back failed", exc_info=True)
            finally:
                # Drop the job (and the request's KV it holds) before it counts as done: freed later,
                # in this frame's teardown after flush() returned, a tensor's free re-takes the GIL
                # while the interpreter may be finalising, and the thread is ended inside torch's
                # C++ frame: "terminate called without an active exception" (exit code 134).
                job = None
                with self._lock:
                    self._waiting -= 1
                    self._bytes -= nbytes
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every submitted job has run (and the worker that ran them has exited)."""
        self._queue.join()
        with self._lock:
            threads = [t for t in self._started if t.is_alive() and t is not threading.current_thread()]
            self._started = threads
        for thread in threads:
            thread.join(timeout=30)

    def close(self) -> None:
        self.flush()


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Keys:
    """The keys a request's measured chunks need (Cache-Craft's statistics read ``k`` only): a copy of
    its KV buffer's keys up to the last sampled query, instead of the whole buffer."""

    __slots__ = ("k",)

    def __init__(self, k) -> None:
        self.k = k

    @classmethod
    def of(cls, buf, taps) -> _Keys:
        end = max((int(t.positions.max()) + 1 for t in taps if t.positions.numel()), default=0)
        return cls(buf.k[:, :, :end].clone())

    @property
    def nbytes(self) -> int:
        return _nbytes(self.k)


class WriteBack:
    """Schedules a request's write-back jobs on a :class:`BackgroundWriter`.

    Args:
        config: the engine's config (``write_back``: keep the KV of missed chunks; chunks shorter than
            ``chunk_min_tokens`` are not kept; ``tree_refresh``: compute blended sequences exactly).
        planner: plans the refreshes; its prefix cache keeps exact prefix blocks.
        variants: where chunk KV is kept, as variants of each chunk.
        run: ``run(job, tokens)`` calls ``job(pause)`` on the engine thread and returns its result
            (for a chunk that has to be computed afresh).
        worker: the engine thread, for the refreshes' background work.
    """

    def __init__(
        self,
        config,
        store: KVStore,
        planner: Planner,
        variants: StoredVariants,
        computer: ChunkComputer,
        *,
        run: Callable[[Callable, int], Any],
        worker: Worker,
        promoted: Callable[[str, list[str]], int] | None = None,
        stored: Callable[[str, list[str]], None] | None = None,
        computed: Callable[[str, list[str]], None] | None = None,
    ) -> None:
        self.config, self.store, self.planner, self.computer, self._run = config, store, planner, computer, run
        self.variants = variants
        self._worker = worker
        self._promoted = promoted
        self._stored = stored
        self._computed = computed
        self._writer = BackgroundWriter()
        self._pending: set = set()
        self._refreshing: dict[tuple, Ticket] = {}  # a refresh's path -> its ticket (waiting or running)
        self._refresh_cond = threading.Condition()
        self._closing = False
        #: knowledge-tree refreshes: ``runs`` done, ``chunks`` kept, ``not_kept`` (the store had no
        #: spare room, or holds that variant already), ``at_cap`` (chunks not computed: they hold
        #: ``max_variants`` already, which a refreshed variant never pushes out), ``preempted``
        #: (started over), ``dropped`` (too many waiting, or given way too often), ``seconds`` of
        #: engine time spent, ``unpromoted`` (chunks left out: past the prompt's leading run of
        #: chunks whose access counts reach the promotion threshold)
        self.refresh_counts = {
            "runs": 0,
            "chunks": 0,
            "not_kept": 0,
            "at_cap": 0,
            "preempted": 0,
            "dropped": 0,
            "seconds": 0.0,
            "unpromoted": 0,
        }

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
        """After the first token: keep the exact prefix blocks and the KV of chunks seen first; refresh
        a blended chunk sequence (``tree_refresh``)."""
        prefix_end = self._keep_prefix(plan, res.capture)
        self._keep_tail(plan, res)
        self._keep_gaps(plan, res)
        exact_end = plan.exact_end()
        spans = [ContextSpan(u.start, u.start + u.length, context_id(plan.segments[u.index].ids)) for u in plan.chunks]
        ranges = [(s.start, s.end) for s in spans]  # the first chunk measured measures them all (one pass)
        kept = {u.index for u in self._kept_misses(plan)} | {i for i in res.chunk_captures if self.keeps(plan)}
        if self._computed is not None:  # the order their KV was first computed in (frequency order's ties)
            self._computed(plan.namespace, [plan.segments[u.index].text for u in plan.chunks if u.index in kept])
        written_exact = set()
        # exact KV a pass not in fixed slices computed: with ``deterministic`` the planner takes it for
        # not held (kvrag.engine.reuse.slices.marked) until the refresh computes it again in slices
        unsliced = set()
        keys, keys_held = None, False  # the keys measured chunks need: one copy for all, counted once
        for n, use in enumerate(plan.chunks):
            if use.index not in kept:
                continue
            cap = res.chunk_captures.get(use.index)
            # a chunk computed here is a variant computed behind this prompt's chunks; exact if it
            # was missed and everything before it was exact (the knowledge tree's path)
            context = use.context if cap is not None else ()
            exact = use.digest if cap is not None and not use.hit and use.start + use.length <= exact_end else None
            job = (use.key, context, exact)
            if exact is not None:
                written_exact.add(use.index)
                if self.planner.slice_tokens and cap.slices is None:
                    unsliced.add(use.index)
            if job in self._pending:
                continue
            ids = list(plan.segments[use.index].ids)
            tap = res.taps.get(use.index)
            nbytes = _nbytes(cap.k, cap.v) if cap is not None else 0
            measured = None
            if tap is not None:
                keys = _Keys.of(res.buf, res.taps.values()) if keys is None else keys
                measured = (tap, keys, spans[:n], ranges)
                nbytes += 0 if keys_held else keys.nbytes
            self._pending.add(job)
            submitted = self._submit(
                lambda job=job, ids=ids, cap=cap, measured=measured: self._write_chunk(job, ids, cap, measured), nbytes
            )
            keys_held |= submitted and tap is not None
            if not submitted:  # dropped: nothing of it is stored
                self._pending.discard(job)
                written_exact.discard(use.index)
        self._tell_stored(plan, written_exact, prefix_end)
        self._schedule_refresh(plan, written_exact - unsliced, unsliced)

    def _tell_stored(self, plan: Plan, written_exact: set[int], prefix_end: int) -> None:
        """Tell the access table the request's leading run of chunks held exactly from now on: reused
        exactly (an exact variant, inside an exact prefix), written back exact, or inside the exact
        prefix this request's capture keeps (``prefix`` mode keeps the whole prompt)."""
        if self._stored is None:
            return
        run = []
        for u in plan.chunks:
            if not (u.source in ("tree", "prefix") or u.index in written_exact or u.start + u.length <= prefix_end):
                break
            run.append(plan.segments[u.index].text)
        if run:
            self._stored(plan.namespace, run)

    def _keep_prefix(self, plan: Plan, capture: KVCapture | None) -> int:
        """Keep the exact prefix blocks a prefill captured; the end of the prefix kept (0: none)."""
        if capture is None:
            return 0
        prompt_ids, bounds, namespace = plan.ids, plan.boundaries, plan.namespace
        kept = self._submit(
            lambda: self.planner.prefix_cache.insert(
                prompt_ids,
                capture.k,
                capture.v,
                capture.start,
                capture.end,
                bounds,
                namespace=namespace,
                slices=capture.slices,
            ),
            _nbytes(capture.k, capture.v),
        )
        return capture.end if kept else 0

    def _keep_tail(self, plan: Plan, res) -> None:
        """Keep the prompt's tail computed exactly, with its last hidden state (``Plan.tail``)."""
        tail = res.tail
        if tail is None or plan.tail_digest is None:
            return
        before, tokens, namespace = plan.tail_digest, plan.ids[tail.start :], plan.namespace
        hidden = res.last_hidden.detach().clone()
        self._submit(
            lambda: self.planner.prefix_cache.insert_tail(
                before, tokens, tail.k, tail.v, hidden, namespace=namespace, slices=tail.slices
            ),
            _nbytes(tail.k, tail.v, hidden),
        )

    def _keep_gaps(self, plan: Plan, res) -> None:
        """Keep the text between chunks computed exactly (``Plan.gap_digests``): a prompt asked again
        places it instead of computing a few rows over cached KV (which rounds otherwise)."""
        insert = self.planner.prefix_cache.insert_gap
        for i, cap in res.gaps.items():
            before = plan.gap_digests.get(i)
            if before is None:
                continue
            seg = plan.segments[i]
            k, v = cap.part(seg.start, seg.end)  # copied here: the request's buffer moves on
            job = functools.partial(insert, before, list(seg.ids), k, v, namespace=plan.namespace, slices=cap.slices)
            self._submit(job, _nbytes(k, v))

    def _submit(self, job: Callable[[], None], nbytes: int) -> bool:
        """Queue a job on the background thread; False if the bounded queue dropped it (counted)."""
        if self._writer.submit(job, nbytes):
            return True
        log.debug("kvrag: write-back queue full: a job of %d bytes dropped", nbytes)
        return False

    def stats(self) -> dict:
        """The write-back queue now: ``queued`` jobs, the ``queued_bytes`` of KV they hold, ``dropped``
        jobs since the engine started (the queue was full), the bounds ``max_jobs`` and ``max_bytes``."""
        return self._writer.stats()

    # -- the knowledge tree's refresh -----------------------------------------------------------------

    def _schedule_refresh(self, plan: Plan, written_exact: set[int], unsliced: set[int]) -> None:
        """Post background work that computes a blended request's chunk sequence exactly (``unsliced``:
        chunks written exact from a pass not in fixed slices, computed again in slices, past the
        promotion gate: they are kept exact already)."""
        if not (self.config.tree_refresh and self.keeps(plan) and plan.chunk_records):
            return
        # chunks whose KV here was not exact and will not be stored exact by the write-back above
        targets = [
            u
            for u in plan.chunks
            if u.digest is not None
            and u.source not in ("tree", "prefix")
            and u.index not in written_exact
            and u.length >= self.config.chunk_min_tokens
        ]
        if targets and self._promoted is not None:  # CRAFT: only the leading run of recurring chunks
            lead = self._promoted(plan.namespace, [plan.segments[u.index].text for u in plan.chunks])
            allowed = {u.index for u in plan.chunks[:lead]} | unsliced
            kept = [u for u in targets if u.index in allowed]
            self.refresh_counts["unpromoted"] += len(targets) - len(kept)
            targets = kept
        if not targets:
            return
        path = (plan.namespace, targets[-1].key, targets[-1].digest)  # the last chunk's digest names the path
        # the whole prompt: its tail (after the last chunk) is kept too, so the same prompt again computes nothing
        segments = plan.segments if plan.tail_digest is not None else plan.segments[: targets[-1].index + 1]
        with self._refresh_cond:
            if self._closing or path in self._refreshing:
                return
            if len(self._refreshing) >= MAX_REFRESHES:
                self.refresh_counts["dropped"] += 1
                return
            self._refreshing[path] = None  # reserved before the ticket exists: flush() waits for it
        self._post_refresh(path, segments, plan.namespace, targets, 0)

    def _post_refresh(self, path, segments, namespace: str, targets: list[ChunkUse], tries: int) -> None:
        # called on the engine thread, so the ticket cannot start before this returns
        tokens = segments[-1].end
        ticket = Ticket(tokens=tokens, compute=tokens, bounded=False, background=True)
        self._worker.post(ticket, lambda pause: self._refresh(path, segments, namespace, targets, tries, pause))
        with self._refresh_cond:
            if path in self._refreshing:
                self._refreshing[path] = ticket
            closing = self._closing
        if closing:  # close() began between the reservation and now: it did not see this ticket
            self._worker.cancel(ticket)
            self._refresh_done(path)

    def _refresh(self, path, segments, namespace: str, targets: list[ChunkUse], tries: int, pause) -> None:
        """On the engine thread: compute ``segments`` exactly (reusing only exact KV) and keep the targets."""
        again, t0 = False, time.perf_counter()
        try:
            # a chunk kept exact here without the slices' mark is replaced in place: it needs no room
            room = [u for u in targets if self.variants.room(u.key) or self.variants.holds_exact(u.key, u.digest)]
            self.refresh_counts["at_cap"] += len(targets) - len(room)
            if not room:  # kept ahead of need, a refreshed variant would push out none: not computed
                return
            if room[-1].index < targets[-1].index:  # the sequence up to the last chunk with room
                segments = segments[: room[-1].index + 1]
            targets = room
            plan = self.planner.plan(
                segments,
                mode="prefix",
                use_prefix=self.config.prefix_cache,
                namespace=namespace,
                exact_only=True,
            )
            computed = {u.index for u in plan.chunks if u.source == "computed"}
            targets = [u for u in targets if u.index in computed]  # not those stored exact meanwhile
            if not targets:
                return
            lead = 0  # deterministic: the lead's prefix blocks a blend's pass kept unmarked, kept again in slices
            if self.planner.slice_tokens and self.config.prefix_cache:
                lead = min(plan.first_chunk_start(), plan.tail_start())
            options = PrefillOptions.from_config(
                self.config,
                self.computer.adapter.n_layers,
                capture_end=lead,
                capture_chunks=tuple(u.index for u in targets),
                capture_tail=plan.tail_digest is not None,
            )
            try:
                res = prefill(self.computer.adapter, plan, plan.num_tokens, options=options, pause=pause)
            except Preempted:
                again = tries + 1 < MAX_REFRESH_TRIES and not self._closing
                self.refresh_counts["preempted" if again else "dropped"] += 1
                return
            self.refresh_counts["runs"] += 1
            self._keep_prefix(plan, res.capture)
            self._keep_tail(plan, res)
            self._keep_gaps(plan, res)
            texts = {
                u.index: [plan.segments[c.index].text for c in plan.chunks[: n + 1]] for n, u in enumerate(plan.chunks)
            }
            for use in targets:
                cap = res.chunk_captures.get(use.index)
                if cap is not None:
                    ids_, path_ = list(plan.segments[use.index].ids), texts[use.index]
                    self._submit(
                        lambda use=use, ids_=ids_, cap=cap, path_=path_: self._keep_refreshed(use, ids_, cap, path_),
                        _nbytes(cap.k, cap.v),
                    )
        finally:
            self.refresh_counts["seconds"] += time.perf_counter() - t0
            if again:
                self._post_refresh(path, segments, namespace, targets, tries + 1)
            else:
                self._refresh_done(path)

    def _keep_refreshed(self, use: ChunkUse, ids: list[int], capture: KVCapture, path: list[str]) -> None:
        record = self.computer.record_from_capture(ids, capture)
        record.meta["computed"] = "refresh"
        kept = self.variants.keep(use.key, record, use.context, use.digest, speculative=True)
        self.refresh_counts["chunks" if kept else "not_kept"] += 1
        if kept and self._stored is not None:  # the sequence up to this chunk is exact now
            self._stored(use.key.namespace, path)

    def _refresh_done(self, path) -> None:
        with self._refresh_cond:
            self._refreshing.pop(path, None)
            self._refresh_cond.notify_all()

    def cancel_refreshes(self) -> None:
        """Take back the refreshes not started yet, and refuse new ones (the engine is closing)."""
        with self._refresh_cond:
            self._closing = True
            waiting = [t for t in self._refreshing.values() if t is not None]
        for ticket in waiting:
            self._worker.cancel(ticket)
        with self._refresh_cond:
            for path in [p for p, t in self._refreshing.items() if t is not None and t.cancelled]:
                del self._refreshing[path]
            self._refresh_cond.notify_all()

    def _write_chunk(self, job, ids: list[int], capture: KVCapture | None, measured=None) -> None:
        key, context, exact = job
        try:
            if capture is None and self.store.contains(key):
                return
            if capture is None or measured is not None:  # model compute: on the engine thread
                record = self._run(lambda pause: self._record(ids, capture, measured, pause), len(ids))
            else:
                record = self._record(ids, capture, None, None)
            self.variants.keep(key, record, context, exact)
        finally:
            self._pending.discard(job)

    def _record(self, ids: list[int], capture: KVCapture | None, measured, pause) -> KVRecord:
        """A missed chunk's record: from the request's capture (with Cache-Craft's statistics from its
        own queries and KV, when measured), or computed alone behind its context."""
        if capture is None:
            return self.computer.compute(ids, pause=pause)
        record = self.computer.record_from_capture(ids, capture)
        if measured is not None:
            tap, buf, context, ranges = measured
            attach_statistics(
                record, tap, buf, (capture.start, capture.end), context, self.computer.adapter, ranges=ranges
            )
        return record

    def flush(self) -> None:
        """Wait until every scheduled job has run; refreshes waiting for an idle engine run now, as
        ordinary work (a request that never ends would otherwise keep them waiting forever)."""
        with self._refresh_cond:
            while self._refreshing:
                for ticket in self._refreshing.values():
                    if ticket is not None:
                        self._worker.promote(ticket)
                self._refresh_cond.wait(timeout=0.05)  # a refresh posted again comes in the background
        self._writer.flush()

    def close(self) -> None:
        self.cancel_refreshes()
        with self._refresh_cond:
            self._refresh_cond.wait_for(lambda: not self._refreshing)
        self._writer.close()
