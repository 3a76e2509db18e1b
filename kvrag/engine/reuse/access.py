"""CRAFT's chunk-access table: how often each chunk was retrieved lately, per tenant.

CRAFT (§4.1-4.2) counts each chunk's accesses over a sliding window of the last ``W`` retrievals
(1,000 in the paper), and uses the counts twice:

- **frequency order**: a retrieval's chunks sorted by descending count, ties kept in retrieval
  order (:func:`frequency_order`), so that popular chunks line up as shared prompt prefixes and an
  exact prefix (or an exact chunk sequence of the knowledge tree) is found more often;
- **promotion**: a chunk sequence is worth keeping exactly only for its leading run of chunks
  whose counts reach the threshold ``tau`` (:meth:`AccessTable.promoted`); a kept prefix grows by
  its next chunk once that one reaches ``tau`` too.

A retrieval is counted once, whatever the number of LLM calls built from it (LlamaIndex's
``compact`` and ``refine`` make several), and each chunk once per retrieval. Keys are content
ids of the chunk texts (whitespace at the ends ignored: frameworks strip texts when they stuff
them into prompts); a document that may reach a prompt in several forms (LlamaIndex's metadata
header, or none) is recorded under each form, so any form it takes in a prompt finds its count.

Tenants (namespaces) have tables of their own: one tenant's traffic never reorders another's
prompts. Everything here is plain Python over strings, thread-safe, testable without a model.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.engine.reuse.documents import content_id
from kvrag.errors import InvalidRequestError

__all__ = ["CHUNK_ORDERS", "AccessStats", "AccessTable", "check_chunk_order", "chunk_key", "frequency_order"]

#: How a retrieval's chunks are put into the prompt: ``retrieval`` (as the retriever ranked them)
#: or ``frequency`` (CRAFT: descending access count in the window, ties in retrieval order).
CHUNK_ORDERS = ("retrieval", "frequency")

#: One document of a retrieval: its text, or the texts of the forms it may take in a prompt.
Document = str | Sequence[str]


def check_chunk_order(order) -> str:
    """``order`` if it names a chunk order, else one :class:`~kvrag.errors.InvalidRequestError` (a
    :class:`ValueError`) that lists them."""
    if order not in CHUNK_ORDERS:
        raise InvalidRequestError(f"unknown chunk order {order!r}; use one of {', '.join(map(repr, CHUNK_ORDERS))}")
    return order


def chunk_key(text: str) -> str:
    """A chunk text's key in the table (its content id, ends stripped)."""
    return content_id(text.strip())


def _keys(document: Document) -> tuple[str, ...]:
    forms = (document,) if isinstance(document, str) else tuple(document)
    if not all(isinstance(f, str) for f in forms):
        raise TypeError(f"a retrieved document is a text or a sequence of its texts, got {document!r}")
    return tuple(dict.fromkeys(chunk_key(f) for f in forms))


def frequency_order(counts: Sequence[int]) -> list[int]:
    """Indices of a retrieval's chunks by descending count; equal counts keep retrieval order.

    ``counts[i]`` is the count of the chunk ranked ``i`` by the retriever. Python's sort is stable,
    so ties (unseen chunks among them) stay where the retriever put them.
    """
    return sorted(range(len(counts)), key=lambda i: -counts[i])


@dataclass(frozen=True, slots=True)
class AccessStats:
    """A tenant's chunk-access table now (:meth:`kvrag.Engine.chunk_access`).

    Attributes:
        window: retrievals the counts cover at most (``None``: every retrieval so far).
        retrievals: retrievals counted now (at most ``window``).
        recorded: retrievals recorded since the engine started (those that left the window too).
        chunks: distinct chunk keys with a count > 0.
        promoted: chunk keys whose count reaches the promotion threshold.
        threshold: the promotion threshold (``EngineConfig.promotion_threshold``).
        top: the most retrieved chunk keys and their counts, most first (at most 10).
    """

    window: int | None
    retrievals: int
    recorded: int
    chunks: int
    promoted: int
    threshold: int
    top: tuple[tuple[str, int], ...] = ()


class _Window:
    """One tenant's counts over its last ``window`` retrievals."""

    __slots__ = ("window", "recent", "counts", "recorded")

    def __init__(self, window: int | None) -> None:
        self.window = window
        self.recent: deque[tuple[str, ...]] = deque()  # each retrieval's distinct keys, oldest first
        self.counts: Counter[str] = Counter()
        self.recorded = 0

    def add(self, keys: tuple[str, ...]) -> None:
        self.recorded += 1
        self.counts.update(keys)
        if self.window is None:
            return
        self.recent.append(keys)
        while len(self.recent) > self.window:
            for key in self.recent.popleft():
                left = self.counts[key] - 1
                if left > 0:
                    self.counts[key] = left
                else:
                    del self.counts[key]  # a chunk out of the window takes no room


class AccessTable:
    """Chunk access counts per namespace over a sliding window of retrievals. Thread-safe.

    Args:
        window: retrievals the counts cover (the last ``window``); ``None`` counts every retrieval
            so far (one counter per distinct chunk ever seen: memory grows with the corpus).
        threshold: CRAFT's promotion threshold tau (>= 1): the count from which a chunk counts as
            recurring (:meth:`promoted`).
    """

    def __init__(self, window: int | None = 1000, threshold: int = 2) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an integer >= 1 or None, got {window!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"threshold must be an integer >= 1, got {threshold!r}")
        self.window = window
        self.threshold = threshold
        self._tables: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def record(self, namespace: str, documents: Sequence[Document]) -> None:
        """Count one retrieval of ``documents`` in ``namespace`` (each distinct chunk once)."""
        keys = tuple(dict.fromkeys(k for d in documents for k in _keys(d)))
        with self._lock:
            table = self._tables.get(namespace)
            if table is None:
                table = self._tables[namespace] = _Window(self.window)
            table.add(keys)

    def counts(self, namespace: str, documents: Sequence[Document]) -> list[int]:
        """Each document's count now (the most of its forms' counts); 0 for one never seen."""
        keyed = [_keys(d) for d in documents]
        with self._lock:
            table = self._tables.get(namespace)
            if table is None:
                return [0] * len(keyed)
            return [max((table.counts.get(k, 0) for k in keys), default=0) for keys in keyed]

    def order(self, namespace: str, documents: Sequence[Document], how: str = "frequency") -> list[int]:
        """The order to put a retrieval's documents in (indices into ``documents``): ``how`` is a
        name of :data:`CHUNK_ORDERS`. Counting is :meth:`record`'s: a retrieval about to be recorded
        gets the same order before as after (each of its chunks gains one)."""
        if check_chunk_order(how) == "retrieval":
            return list(range(len(documents)))
        return frequency_order(self.counts(namespace, documents))

    def counting(self, namespace: str) -> bool:
        """Whether any retrieval was recorded in ``namespace`` (promotion needs counts to gate on)."""
        with self._lock:
            table = self._tables.get(namespace)
            return table is not None and table.recorded > 0

    def promoted(self, namespace: str, texts: Sequence[str]) -> int:
        """How many leading chunks of a prompt (its chunk texts, in order) reach the threshold.

        CRAFT's chunk-prefix promotion: a sequence is kept exactly only up to the first chunk that
        is not recurring yet. In a namespace where nothing was recorded there are no counts to gate
        on: every chunk passes (``len(texts)``), so an application that tells the engine of no
        retrievals keeps the behaviour it had.
        """
        with self._lock:
            table = self._tables.get(namespace)
            if table is None or table.recorded == 0:
                return len(texts)
            for n, text in enumerate(texts):
                if table.counts.get(chunk_key(text), 0) < self.threshold:
                    return n
            return len(texts)

    def stats(self, namespace: str, top: int = 10) -> AccessStats:
        with self._lock:
            table = self._tables.get(namespace) or _Window(self.window)
            held = len(table.recent) if self.window is not None else table.recorded
            return AccessStats(
                window=self.window,
                retrievals=held,
                recorded=table.recorded,
                chunks=len(table.counts),
                promoted=sum(c >= self.threshold for c in table.counts.values()),
                threshold=self.threshold,
                top=tuple(table.counts.most_common(top)),
            )

    def namespaces(self) -> list[str]:
        with self._lock:
            return list(self._tables)

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
