"""RAGCache's dynamic speculative pipelining (§5.3, Algorithm 2, Theorem 5.1): prefill while the search runs.

A staged vector search (:mod:`kvrag.integrations.staged_search`) reports its top-k after each
stage. Whenever that list changes, the caller asks the engine to speculate on it:

- **chunk-level** (:meth:`~kvrag.Engine.speculate`): the KV of the candidates the cache does not
  hold is computed and kept as *speculative* store entries (they take only free room, and go
  first, as the refresh's do); a chunk finished stays useful whatever the search decides.
- **prompt-level** (:meth:`~kvrag.Engine.speculate_request`): the whole prompt the final list
  would make is prefilled and its first token sampled; the KV buffer is held. A final request
  identical to it (same tokens, mode, ratio, selection, sampling, tenant) *adopts* it: no prefill
  is run again and its first token comes at once. Anything else runs afresh.

Each speculation is one *speculative* ticket of the engine thread
(:mod:`kvrag.engine.serving.scheduler`): it starts only when no request waits, and stops at its
next pause when one arrives or when it is cancelled (a newer list of the same ``key``, Algorithm 2
line 8). That is Theorem 5.1's rule with one prefill at a time: speculate iff the pool is empty
after a changed stage; a speculation that loses costs only idle engine time.

**Tenants.** A speculation belongs to its tenant (namespace): its key is scoped to it (one tenant
never replaces or cancels another's), and the :data:`MAX_LIVE` speculations are shared by the fair
rule (:mod:`kvrag.engine.store.tenants`): past the bound, the tenant holding the most live ones (the
new one's own on a tie) loses its oldest.

A speculation never counts as a use of the cache: its lookups are looks (no hit counted, no
eviction rank touched), and a prompt speculation's write-back waits for its adoption (a lost one
leaves the store as it found it). ``Request.speculative`` marks its request for the layers that
count accesses.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from kvrag.engine.serving.scheduler import Ticket
from kvrag.engine.serving.worker import Pause, Preempted, Worker
from kvrag.engine.store.tenants import fair_victim

__all__ = ["Speculation", "Speculations", "MAX_LIVE"]

#: Most speculations held at once, all tenants together (each prompt speculation holds a KV buffer);
#: a new one past that cancels the oldest of the tenant holding the most (its own on a tie).
MAX_LIVE = 8

#: A speculation's states: queued, prefilling, finished (its result held), stopped part-way
#: (preempted or cancelled while running), cancelled before it started, adopted by a request,
#: failed (an error: a final request computes afresh and meets it there).
STATES = ("waiting", "running", "done", "stopped", "cancelled", "adopted", "failed")


class Speculation:
    """A handle on one speculation: cancel it, wait for it, see what it did.

    Attributes:
        kind: ``"chunks"`` or ``"prompt"``.
        key: the caller's request key (a newer speculation of the same key and tenant cancels this
            one), or None.
        namespace: its tenant.
        tokens: tokens its work computes at most (prompt: the prefill's estimate; chunks: the
            uncached candidates' tokens).
        state: one of :data:`STATES`.
        computed: tokens of work done (an estimate for a stopped one: the share of its layers run).
        result: what it produced (chunks: how many chunks it kept; prompt: held for its adoption).
    """

    def __init__(
        self, manager: Speculations, kind: str, key: Hashable | None, tokens: int, signature=None, namespace: str = ""
    ) -> None:
        self._manager = manager
        self.kind, self.key, self.tokens, self.signature = kind, key, tokens, signature
        self.namespace = namespace
        self.ticket: Ticket | None = None
        self.state = "waiting"
        self.computed = 0
        self.result: Any = None
        self.started_at: float | None = None  # time.perf_counter() when its job began on the engine thread
        self.pauses = 0  # pauses its job has passed (the runner pauses twice per layer)
        self.window: tuple[int, int] | None = None  # chunks: (tokens, pauses at its start) of the pass running
        self._done = threading.Event()

    @property
    def finished(self) -> bool:
        """It will not run (any more): done, stopped, cancelled, adopted or failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until it finished (see :attr:`finished`); False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Give it up: a waiting one leaves the queue, a running one stops at its next pause, a held
        prompt prefill is dropped (its KV freed). Finished chunks stay stored. No-op once adopted."""
        self._manager.cancel(self)

    def __repr__(self) -> str:
        return f"Speculation({self.kind}, key={self.key!r}, state={self.state}, tokens={self.tokens})"


class Speculations:
    """The live speculations of one engine: at most one per tenant and key, at most :data:`MAX_LIVE`
    in all (shared by the fair rule).

    Args:
        worker: the engine thread.
        layers: the model's layers (the runner pauses twice per layer: a stopped speculation's
            work done is estimated from its pauses).
        namespace: the tenant of calls that name none (the engine's ``EngineConfig.namespace``).
    """

    def __init__(self, worker: Worker, layers: int, namespace: str = "default") -> None:
        self._worker = worker
        self.namespace = namespace
        self._pauses_per_pass = 2 * max(1, layers)
        self._lock = threading.Lock()
        self._live: OrderedDict[int, Speculation] = OrderedDict()  # id(handle) -> handle, oldest first
        self._by_key: dict[tuple, Speculation] = {}
        #: ``started`` (ran on the engine thread), ``done``, ``stopped`` (preempted or cancelled while
        #: running), ``cancelled`` (before starting), ``adopted``, ``wasted_tokens`` (tokens computed
        #: by speculations that ended unused; a chunk speculation's finished chunks are not waste),
        #: ``seconds`` of engine time
        self.counts = {
            "started": 0,
            "done": 0,
            "stopped": 0,
            "cancelled": 0,
            "adopted": 0,
            "failed": 0,
            "wasted_tokens": 0,
            "seconds": 0.0,
        }

    def start(
        self,
        kind: str,
        key: Hashable | None,
        tokens: int,
        job: Callable[[Speculation, Pause], Any],
        *,
        signature=None,
        dynamic: bool = True,
        namespace: str | None = None,
    ) -> Speculation:
        """Queue ``job(handle, pause)`` as a speculative ticket of tenant ``namespace`` (``dynamic=False``:
        as ordinary work, which never gives way: the always-speculate baseline). A live speculation
        of the same ``(namespace, kind, key)`` is cancelled first."""
        namespace = self.namespace if namespace is None else namespace
        handle = Speculation(self, kind, key, tokens, signature, namespace)
        slot = (namespace, kind, key)
        if tokens <= 0 and kind == "chunks":  # nothing to compute: it replaces the key's old one and is done
            with self._lock:
                old = self._by_key.pop(slot, None) if key is not None else None
            if old is not None:
                self.cancel(old)
            handle.state, handle.result = "done", 0
            handle._done.set()
            return handle
        ticket = Ticket(tokens=tokens, compute=max(1, tokens), bounded=False, speculative=dynamic)
        handle.ticket = ticket
        with self._lock:
            old = self._by_key.get(slot) if key is not None else None
            if key is not None:
                self._by_key[slot] = handle
            self._live[id(handle)] = handle
            evicted = None
            others = [h for h in self._live.values() if h is not old and h is not handle]
            if len(others) >= MAX_LIVE:  # the new one never goes: the tenant holding the most gives way
                tenant = fair_victim(Counter(h.namespace for h in others), namespace, 1)
                evicted = next(h for h in others if h.namespace == tenant)
        for stale in (old, evicted):
            if stale is not None and stale is not handle:
                self.cancel(stale)
        self._worker.post(ticket, lambda pause: self._run(handle, job, pause))
        return handle

    def _run(self, handle: Speculation, job, pause: Pause) -> None:
        """On the engine thread."""
        with self._lock:
            if handle.state != "waiting":  # cancelled between the queue and now
                return
            handle.state = "running"
            handle.started_at = time.perf_counter()
        self.counts["started"] += 1

        def counted() -> None:
            handle.pauses += 1
            pause()

        t0 = time.perf_counter()
        state, wasted = "done", 0
        try:
            handle.result = job(handle, counted)
            handle.computed = handle.tokens
        except Preempted:
            state = "stopped"
            if handle.kind == "prompt":
                handle.computed = wasted = self._share(handle.tokens, handle.pauses)
            elif handle.window is not None:  # the chunks of the pass it stopped in: the rest are stored
                tokens, start = handle.window
                wasted = self._share(tokens, handle.pauses - start)
                handle.computed += wasted
        except Exception as exc:  # the final request computes afresh and meets it itself
            state, handle.result = "failed", exc
        finally:
            self.counts["seconds"] += time.perf_counter() - t0
        with self._lock:
            if handle.state == "running":
                handle.state = state
            elif handle.state == "cancelled" and state == "done" and handle.kind == "prompt":
                wasted = handle.tokens  # finished after its cancellation: nobody takes it
                handle.result = None
            if handle.state in ("stopped", "failed") or (handle.state == "cancelled" and state != "done"):
                self._forget(handle)
        self.counts[state] += 1
        self.counts["wasted_tokens"] += wasted
        if handle.kind == "chunks":  # nothing to adopt: its chunks are stored
            with self._lock:
                self._forget(handle)
        handle._done.set()

    def _share(self, tokens: int, pauses: int) -> int:
        """Tokens of a pass over ``tokens`` that ``pauses`` pauses have computed."""
        return min(tokens, tokens * pauses // self._pauses_per_pass)

    def cancel(self, handle: Speculation) -> None:
        """See :meth:`Speculation.cancel`."""
        wasted = 0
        with self._lock:
            state = handle.state
            if state in ("adopted", "cancelled", "stopped", "failed"):
                return
            handle.state = "cancelled"
            if state == "done" and handle.kind == "prompt":  # a held prefill nobody will take
                wasted, handle.result = handle.tokens, None
            self._forget(handle)
        if state == "waiting":
            self.counts["cancelled"] += 1
        self.counts["wasted_tokens"] += wasted
        if state in ("waiting", "running"):
            self._worker.cancel(handle.ticket)  # a running one stops at its next pause
        if state in ("waiting", "done"):
            handle._done.set()

    def adopt(self, signature) -> Speculation | None:
        """The live prompt speculation a request with ``signature`` takes over, or None.

        A finished one hands over its held prefill; a running one is promoted (it no longer gives
        way: the request waits for it as for its own prefill); a waiting one is cancelled (nothing
        computed yet: the request runs afresh)."""
        with self._lock:
            handle = next(
                (h for h in reversed(self._live.values()) if h.kind == "prompt" and h.signature == signature), None
            )
            if handle is None:
                return None
            state = handle.state
            if state in ("done", "running"):
                handle.state = "adopted" if state == "done" else "running"
                handle.signature = None  # no second request takes it
                self._forget(handle)
        if state == "waiting":
            self.cancel(handle)
            return None
        if state == "running":
            self._worker.promote(handle.ticket)
        return handle

    def take(self, handle: Speculation) -> Any:
        """On the engine thread, when the adopting request starts: the held result, or None (the
        speculation was stopped, failed, or its job is not run)."""
        with self._lock:
            if handle.state not in ("done", "adopted"):
                return None
            handle.state = "adopted"
            result, handle.result = handle.result, None
        self.counts["adopted"] += 1
        return result

    def cancel_key(self, key: Hashable, namespace: str | None = None) -> bool:
        """Cancel tenant ``namespace``'s live speculations (chunk and prompt) of ``key``; False if it had none."""
        namespace = self.namespace if namespace is None else namespace
        with self._lock:
            slots = [(namespace, kind, key) for kind in ("chunks", "prompt")]
            handles = [h for slot in slots if (h := self._by_key.get(slot)) is not None]
        for handle in handles:
            self.cancel(handle)
        return bool(handles)

    def live(self) -> list[Speculation]:
        """The speculations not finished or held for adoption, oldest first."""
        with self._lock:
            return list(self._live.values())

    def cancel_all(self) -> None:
        """Cancel every live speculation (the engine is closing)."""
        for handle in self.live():
            self.cancel(handle)

    def _forget(self, handle: Speculation) -> None:
        """Drop a handle from the live tables (the lock held)."""
        self._live.pop(id(handle), None)
        slot = (handle.namespace, handle.kind, handle.key)
        if handle.key is not None and self._by_key.get(slot) is handle:
            del self._by_key[slot]
