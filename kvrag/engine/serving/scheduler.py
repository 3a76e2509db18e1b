"""Which waiting work the engine thread starts next: bounds, cache-aware order, no starvation.

Plain Python over :class:`Ticket` objects (no tensors, no threads: the worker calls it under its
own lock), in the manner of nano-vllm's scheduler. The rules:

- **Bounds.** At most ``max_running`` requests hold a decoding slot (the one prefilling
  included); each holds its KV buffer until its last token. At most ``max_queued`` tickets wait,
  holding at most ``max_queued_tokens`` prompt tokens together (a lone ticket may exceed it).
  A submission beyond either bound raises :class:`~kvrag.errors.OverloadedError` at once:
  the queue never grows without bound. Internal work (write-back) is not bounded here: its own
  queue deduplicates it.
- **Order** (RAGCache §5.2). Among the tickets that can start, the highest ratio of cached
  tokens to tokens to compute goes first (it gets the most out of the cache while its entries
  are resident, and it is short); ties go in arrival order.
- **Starvation window.** Every time a ticket is started ahead of an older one, the older one
  counts it; a ticket passed over ``starvation_window`` times starts before anything else
  (oldest first). So no ticket waits behind more than that many later arrivals.
- **Background work** (a ``background`` ticket: the knowledge tree's refresh) starts only when the
  engine is idle: no other ticket waits and no request is decoding; oldest first. The worker stops
  a running one as soon as other work arrives (:meth:`Scheduler.has_foreground`).
- **Speculative work** (a ``speculative`` ticket: RAGCache's speculative prefill while the vector
  search still runs, §5.3) starts only when no foreground ticket waits (requests may be decoding:
  their steps run at its pauses, as for any prefill), oldest first, before any background work.
  It never counts in the starvation window (it passes no one and is never passed), takes no
  queue bound, and the worker stops it at its next pause as soon as foreground work arrives or it
  is cancelled (Theorem 5.1: speculate only into an empty pool).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvrag.errors import OverloadedError

__all__ = ["Ticket", "Scheduler"]


@dataclass(slots=True, eq=False)
class Ticket:
    """One unit of work for the engine thread: a request, a score, a warm window, a write-back.

    Attributes:
        tokens: prompt tokens it holds while it waits (its share of ``max_queued_tokens``).
        cached: of those, tokens whose KV is cached (estimated when it is submitted).
        compute: tokens its prefill computes (at least 1).
        decodes: it decodes after its prefill, holding a running slot until its last token.
        bounded: it counts against the queue bounds (internal work does not).
        background: it runs only when the engine is idle, and gives way to any other ticket.
        speculative: it runs only when no foreground ticket waits (before background work), and
            gives way to any foreground ticket.
        payload: what the worker runs (opaque here).
        arrival: submission order, set by the scheduler.
        passed: how many later tickets started before it.
        cancelled: the caller gave up; the worker drops it.
    """

    tokens: int
    cached: int = 0
    compute: int = 1
    decodes: bool = False
    bounded: bool = True
    background: bool = False
    speculative: bool = False
    payload: object = None
    arrival: int = -1
    passed: int = 0
    cancelled: bool = False

    @property
    def foreground(self) -> bool:
        """Ordinary work: neither background nor speculative."""
        return not (self.background or self.speculative)

    @property
    def priority(self) -> float:
        """RAGCache's cache-aware priority: cached length / compute length."""
        return self.cached / max(1, self.compute)


class Scheduler:
    """Admission control and order of waiting tickets (not thread-safe: the worker holds its lock).

    Args:
        max_running: most tickets holding a decoding slot at once.
        max_queued: most bounded tickets waiting.
        max_queued_tokens: most prompt tokens of bounded tickets waiting (a ticket alone may exceed it).
        starvation_window: later tickets that may start before a waiting one.
    """

    def __init__(self, *, max_running: int, max_queued: int, max_queued_tokens: int, starvation_window: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_queued_tokens = max_queued_tokens
        self.starvation_window = starvation_window
        self.waiting: list[Ticket] = []  # in arrival order
        self.running = 0  # tickets holding a decoding slot
        self._arrivals = itertools.count()

    @property
    def queued_tokens(self) -> int:
        return sum(t.tokens for t in self.waiting if t.bounded)

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket, or raise :class:`OverloadedError` if a bound would be passed."""
        if ticket.bounded:
            queued = [t for t in self.waiting if t.bounded]
            if len(queued) >= self.max_queued:
                raise OverloadedError(f"{len(queued)} requests are waiting (max_queued={self.max_queued})")
            tokens = sum(t.tokens for t in queued)
            if queued and tokens + ticket.tokens > self.max_queued_tokens:
                raise OverloadedError(
                    f"{tokens} prompt tokens are waiting and this request brings {ticket.tokens} "
                    f"(max_queued_tokens={self.max_queued_tokens})"
                )
        ticket.arrival = next(self._arrivals)
        self.waiting.append(ticket)

    def next(self) -> Ticket | None:
        """The ticket to start now (removed from the queue; a decoding one takes a slot), or None."""
        startable = [t for t in self.waiting if t.foreground and (not t.decodes or self.running < self.max_running)]
        if not startable:
            pick = None
            if not self.has_foreground():
                pick = next((t for t in self.waiting if t.speculative), None)
                if pick is None and self.running == 0:
                    pick = next((t for t in self.waiting if t.background), None)
            if pick is not None:
                self.waiting.remove(pick)
                if pick.decodes:
                    self.running += 1
            return pick
        starved = [t for t in startable if t.passed >= self.starvation_window]
        pick = starved[0] if starved else min(startable, key=lambda t: (-t.priority, t.arrival))
        self.waiting.remove(pick)
        for t in self.waiting:
            if t.arrival < pick.arrival and t.foreground:
                t.passed += 1
        if pick.decodes:
            self.running += 1
        return pick

    def has_foreground(self) -> bool:
        """Whether any ticket other than background or speculative work waits."""
        return any(t.foreground for t in self.waiting)

    def cancel(self, ticket: Ticket) -> bool:
        """Take a waiting ticket out of the queue; False if it is not waiting."""
        ticket.cancelled = True
        if ticket in self.waiting:
            self.waiting.remove(ticket)
            return True
        return False

    def finish(self, ticket: Ticket) -> None:
        """A started ticket is done: its slot (if it had one) is free."""
        if ticket.decodes:
            self.running -= 1
