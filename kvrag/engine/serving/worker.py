"""The engine thread: the one thread that runs the model.

Callers never touch torch. They hand the :class:`Worker` a :class:`~kvrag.engine.serving.scheduler.Ticket`
and wait: a one-shot call (a score, a warm window, a write-back chunk) returns its result; a
request streams its text pieces through a queue, then its :class:`~kvrag.engine.types.Generation`.

The thread alternates two kinds of work:

- **Decode steps.** Every running request advances one token per step, all in one batched pass
  (:func:`~kvrag.engine.model.batch.decode_step`).
- **Prefill slices.** The next ticket the scheduler picks runs its prefill (or its call) with a
  *pause* hook that the runner calls twice per layer (after attention, after the MLP). Once a
  prefill has run ``slice_s`` seconds since the last decode step, the hook runs one decode step
  there, so no running stream waits for a whole prompt. A pause changes nothing in the
  prefill's arithmetic: its output does not depend on what else runs. The hook also ends the
  prefill of a request whose consumer has gone.

The thread starts with the first ticket and, once nothing waits or runs, waits :data:`LINGER_S` for
more before it exits (a new one starts with the next ticket): an engine that is idle, or dropped
without ``close()``, keeps no thread for long, and ``close()`` ends it at once (:meth:`Worker.stop`).
It lingers because a new thread's first parallel torch op starts its OpenMP pool, milliseconds that
a thread keeping its pool does not pay, and that every request of an app would pay, its condense and
answer calls apiece (``kvrag.engine.model.host``; figures: docs/journal/figures-from-code.md).
With ``linger_s=None`` (a server) the thread starts when the engine is built, from the thread that
builds it, and stays until ``close()``: a thread inherits its creator's scheduling priority, so the
engine thread keeps the priority the process started with even if the server then lowers its HTTP
threads' (``kvrag serve --http-nice``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvrag.engine.serving.scheduler import Scheduler, Ticket

log = logging.getLogger(__name__)

#: Seconds an idle engine thread waits for more work before it exits (calls of one app request,
#: a chat engine's condense and answer, come within milliseconds of each other).
LINGER_S = 1.0

#: Every worker of the process: when one starts work, the others' idle threads stop lingering, so a
#: process that alternates engines (a benchmark's float32 engine beside its bf16 one) does not keep
#: two OpenMP pools on the cores.
_WORKERS: weakref.WeakSet = weakref.WeakSet()
_WORKERS_LOCK = threading.Lock()  # engines may be built while another submits

__all__ = ["Pause", "Preempted", "Worker", "StreamJob"]

#: The runner calls it between slices of a prefill: it may run a decode step of other requests there.
Pause = Callable[[], None]

_PIECE, _DONE, _ERROR, _CLOSED = range(4)


def _not_driven(*_args):
    raise RuntimeError("kvrag: the engine thread was given a request before Worker.drive()")


class _Cancelled(Exception):
    """Raised by the pause hook inside the prefill of a request whose consumer has gone."""


class Preempted(Exception):
    """Raised by the pause hook inside background or speculative work when other work is waiting (or
    it was cancelled): it gives way."""


@dataclass(slots=True, eq=False)
class StreamJob:
    """A request's life on the engine thread: its prefill input, its running sequence, its output."""

    req: Any  # kvrag.engine.serving.requests.Request
    t0: float
    seq: Any = None  # kvrag.engine.serving.sequence.RunningSequence once prefilled; dropped when it ends
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


@dataclass(slots=True, eq=False)
class _Call:
    fn: Callable[[Pause], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class Worker:
    """Runs tickets and decode steps on one thread.

    What a request's life runs is handed in by :meth:`drive` before the first request (the prefill
    and decode modules: :mod:`kvrag.engine.serving.prefill`, :mod:`kvrag.engine.serving.decode`).

    Args:
        scheduler: admission and order of waiting tickets.
        eos_ids: end-of-sequence token ids.
        slice_s: seconds of prefill between two decode steps while requests are running.
        setup: run first on each engine thread (the engine sets its torch thread count there).
        linger_s: seconds an idle thread waits for more work before it exits; ``None``: the thread
            starts at :meth:`drive` and stays until :meth:`stop` (the module docstring says why).
    """

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        eos_ids: set[int],
        slice_s: float,
        setup: Callable[[], None] = lambda: None,
        linger_s: float | None = LINGER_S,
    ) -> None:
        self.scheduler = scheduler
        self._start_fn = self._step_fn = self._finish_fn = _not_driven
        self.eos_ids = eos_ids
        self.slice_s = slice_s
        self._setup = setup
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running: list[Ticket] = []  # tickets whose sequence decodes (engine thread only)
        self._current: Ticket | None = None  # the ticket prefilling now
        self._last_step = 0.0
        self.steps = 0  # decode steps run (for tests and metrics)
        self._busy_s = 0.0  # seconds the engine thread has run, its running stretch excluded (see stats)
        self._busy_since: float | None = None  # when the running stretch began (None: idle, or no thread)
        self._submitted = 0  # tickets submitted so far (a lingering thread wakes when it changes)
        # 0 once stopped: the thread exits as soon as it is idle; None: it stays (kept, see the module docstring)
        self._linger = linger_s
        self._cut = False  # another worker started work: an idle lingering thread stops lingering now
        with _WORKERS_LOCK:
            _WORKERS.add(self)

    def drive(
        self,
        *,
        start: Callable[[Any, float, Pause], Any],
        step: Callable[[list], None],
        finish: Callable[[Any], Any],
    ) -> None:
        """What runs a request's life on this thread.

        Args:
            start: ``(request, t0, pause) -> sequence``: prefill a request and sample its first token.
            step: ``(sequences) -> None``: advance each sequence by one token (a batched decode step).
            finish: ``(sequence) -> Generation``: the result of a sequence that is done.
        """
        self._start_fn, self._step_fn, self._finish_fn = start, step, finish
        with self._cond:
            if self._linger is None and self._thread is None:  # kept: it starts now, from the builder's thread
                self._thread = threading.Thread(target=self._loop, name="kvrag-engine", daemon=True)
                self._thread.start()

    # -- callers' side ------------------------------------------------------------------------

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket (raises :class:`~kvrag.errors.OverloadedError` when full); the thread wakes."""
        with self._cond:
            self.scheduler.submit(ticket)
            self._submitted += 1
            starts = self._busy_since is None  # a running stretch begins (on a new or a lingering thread)
            if starts:
                self._busy_since = time.perf_counter()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvrag-engine", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if starts:  # outside this worker's lock: each worker takes only its own
            with _WORKERS_LOCK:
                others = [w for w in _WORKERS if w is not self]
            for other in others:
                other._cut_linger()

    def call(self, ticket: Ticket, fn: Callable[[Pause], Any]) -> Any:
        """Run ``fn(pause)`` on the engine thread and return its result (its error is raised here)."""
        if threading.current_thread() is self._thread:  # already on the engine thread
            return fn(self._pause)
        job = _Call(fn)
        ticket.payload = job
        self.submit(ticket)
        try:
            job.done.wait()
        except BaseException:  # the caller was interrupted: drop the ticket if it has not started
            self.cancel(ticket)
            raise
        if job.error is not None:
            raise job.error
        return job.result

    def post(self, ticket: Ticket, fn: Callable[[Pause], Any]) -> None:
        """Queue ``fn(pause)`` for the engine thread and return at once (what it raises is logged)."""

        def run(pause: Pause) -> None:
            try:
                fn(pause)
            except Exception:
                log.warning("kvrag: background work failed", exc_info=True)

        ticket.payload = _Call(run)
        self.submit(ticket)

    def promote(self, ticket: Ticket) -> None:
        """Background or speculative work runs from now on as ordinary work (it no longer waits for an
        idle engine, nor gives way to other work)."""
        with self._cond:
            ticket.background = ticket.speculative = False
            self._cond.notify_all()

    def stream(self, ticket: Ticket, job: StreamJob) -> Iterator[str]:
        """Queue a request now; the iterator returned yields its text pieces and returns its Generation.

        Closing the iterator early (or dropping it) cancels the request: a waiting one leaves the
        queue, a prefilling one stops at its next pause, a decoding one leaves the batch; its KV
        is freed.
        """
        ticket.payload = job
        ticket.decodes = True
        self.submit(ticket)
        return _Pieces(self, ticket, job)

    def cancel(self, ticket: Ticket) -> None:
        """The caller gives up on a ticket (waiting, prefilling or decoding)."""
        with self._cond:
            self.scheduler.cancel(ticket)
            self._cond.notify_all()

    def stats(self) -> dict:
        """Requests decoding (``running``, the one prefilling included), tickets and prompt tokens
        waiting (``waiting``, ``queued_tokens``), decode steps run so far (``decode_steps``), and
        ``busy_s``: seconds the engine thread has had work so far (it runs only while something
        waits or runs, so this is the engine's busy time, idle gaps left out)."""
        with self._cond:
            since = self._busy_since
            return {
                "running": self.scheduler.running,
                "waiting": len(self.scheduler.waiting),
                "queued_tokens": self.scheduler.queued_tokens,
                "decode_steps": self.steps,
                "busy_s": self._busy_s + (time.perf_counter() - since if since is not None else 0.0),
            }

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing waits or runs (the thread may linger); False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._busy_since is None or self._thread is threading.current_thread(), timeout
            )

    def stop(self, timeout: float | None = None) -> bool:
        """From now on the thread exits as soon as nothing waits or runs; wait until it has (False if
        ``timeout`` passed first). Work submitted later still runs, on a thread that does not linger."""
        with self._cond:
            self._linger = 0.0
            self._cond.notify_all()
            return self._cond.wait_for(
                lambda: self._thread is None or self._thread is threading.current_thread(), timeout
            )

    # -- the engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._setup()
            while True:
                with self._cond:
                    self._drop_cancelled()
                    ticket = self.scheduler.next()
                    if ticket is None and not self._running:
                        self._idle()
                        self._cond.notify_all()
                        if not self._linger_for_more():  # nothing came: the thread ends
                            self._thread = None
                            self._cond.notify_all()
                            return
                        continue
                if ticket is None:
                    self._step()
                    continue
                if self._due():
                    self._step()
                self._run(ticket)
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            with self._cond:
                self._idle()
            log.exception("kvrag: the engine thread failed")
            self._fail_all(exc)
            raise

    def _cut_linger(self) -> None:
        """Another worker started work: if this one's thread is idle, it exits now."""
        with self._cond:
            if self._thread is not None and self._busy_since is None:
                self._cut = True
                self._cond.notify_all()

    def release(self, timeout: float | None = None) -> bool:
        """If the thread is idle, end it now instead of at the end of its linger, and wait until it has
        (False if ``timeout`` passed first, or the thread is kept; the next work starts a new thread). For
        torch work of the caller's that should not share the cores with the engine thread's pool (a
        benchmark's baseline)."""
        if self._linger is None:
            return False
        self._cut_linger()
        with self._cond:
            return self._cond.wait_for(lambda: self._thread is None or self._busy_since is not None, timeout)

    def _linger_for_more(self) -> bool:
        """Idle (the condition held): wait up to the linger for another ticket; whether one came."""
        seen = self._submitted
        kept = self._linger is None  # waits until work comes or stop(); another worker's start does not end it
        self._cond.wait_for(
            lambda: self._submitted != seen or self._linger == 0 or (self._cut and not kept), self._linger
        )
        self._cut = False
        return self._submitted != seen

    def _idle(self) -> None:
        """The thread runs out of work (the condition held): its running stretch counts as busy time."""
        if self._busy_since is not None:
            self._busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None

    def _run(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            self._release(ticket)
            return
        job = ticket.payload
        self._current = ticket
        try:
            if isinstance(job, _Call):
                try:
                    job.result = job.fn(self._pause)
                except BaseException as exc:
                    job.error = exc
                finally:
                    job.done.set()
                    self._release(ticket)
                return
            try:
                job.seq = self._start_fn(job.req, job.t0, self._pause)
            except _Cancelled:
                self._release(ticket)
                return
            except Exception as exc:
                self._end(ticket, _ERROR, exc)
                return
        finally:
            self._current = None
        self._running.append(ticket)
        self._advance(ticket)

    def _pause(self) -> None:
        """Between slices of a prefill: stop it if its consumer left, or if it is background work and
        other work waits; run a decode step if one is due."""
        current = self._current
        if current is not None and current.cancelled and isinstance(current.payload, StreamJob):
            raise _Cancelled
        if current is not None and not current.foreground:  # background or speculative work gives way
            with self._cond:
                if current.cancelled or self.scheduler.has_foreground():
                    raise Preempted
        elif current is not None and current.cancelled and isinstance(current.payload, _Call):
            raise Preempted  # a job whose caller gave up (or a speculation run as ordinary work, cancelled)
        if self._due():
            self._step()

    def _due(self) -> bool:
        return bool(self._running) and time.perf_counter() - self._last_step >= self.slice_s

    def _step(self) -> None:
        """One decode step of every running request."""
        self._drop_cancelled()
        tickets = list(self._running)
        if not tickets:
            return
        try:
            self._step_fn([t.payload.seq for t in tickets])
        except Exception as exc:  # the step failed for all of them
            log.exception("kvrag: a decode step failed")
            for t in tickets:
                self._end(t, _ERROR, exc)
            return
        finally:
            self._last_step = time.perf_counter()
            self.steps += 1
        for t in tickets:
            self._advance(t)

    def _advance(self, ticket: Ticket) -> None:
        """Emit the sequence's new token; finish it if it is done."""
        job: StreamJob = ticket.payload
        seq = job.seq
        piece = seq.accept(frozenset() if seq.req.sampling.ignore_eos else self.eos_ids)
        if piece:
            job.out.put((_PIECE, piece))
        after = getattr(seq, "after_first_token", None)
        if after is not None:  # the first token is out: what the request leaves behind (write-back)
            seq.after_first_token = None
            try:
                after()
            except Exception:  # a failed write-back only costs a future hit, never the answer
                log.warning("kvrag: scheduling write-back failed", exc_info=True)
        if not seq.done:
            return
        tail = seq.text.flush()
        if tail:
            job.out.put((_PIECE, tail))
        try:
            result = self._finish_fn(seq)
        except Exception as exc:
            self._end(ticket, _ERROR, exc)
            return
        self._end(ticket, _DONE, result)

    def _end(self, ticket: Ticket, kind: int, value: Any) -> None:
        ticket.payload.out.put((kind, value))
        self._release(ticket)

    def _release(self, ticket: Ticket) -> None:
        """A started ticket is over: its slot is free and its KV is dropped."""
        if ticket in self._running:
            self._running.remove(ticket)
        if isinstance(ticket.payload, StreamJob):
            ticket.payload.seq = None
        with self._cond:
            self.scheduler.finish(ticket)

    def _drop_cancelled(self) -> None:
        for t in [t for t in self._running if t.cancelled]:
            self._release(t)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            tickets = list(self._running) + list(self.scheduler.waiting)
            self.scheduler.waiting.clear()
            self._running.clear()
            self._thread = None
            self._cond.notify_all()
        for t in tickets:
            job = t.payload
            if isinstance(job, _Call):
                job.error = exc
                job.done.set()
            elif isinstance(job, StreamJob):
                job.out.put((_ERROR, exc))


class _Pieces:
    """A request's text pieces as the engine thread posts them; ``StopIteration.value`` is its Generation.

    Not a generator: closing (or dropping) one that was never iterated must still cancel its request.
    """

    def __init__(self, worker: Worker, ticket: Ticket, job: StreamJob) -> None:
        self._worker, self._ticket, self._job = worker, ticket, job
        self._ended = False

    def __iter__(self) -> _Pieces:
        return self

    def __next__(self) -> str:
        if self._ended:
            raise StopIteration
        kind, value = self._job.out.get()
        if kind == _PIECE:
            return value
        self._ended = True
        if kind == _ERROR:
            raise value
        if kind == _CLOSED:  # closed from another thread while this one waited for a piece
            raise StopIteration
        raise StopIteration(value)

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            self._worker.cancel(self._ticket)
            self._job.out.put((_CLOSED, None))  # wakes a consumer blocked in __next__ on another thread

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the worker may be half torn down
            pass
