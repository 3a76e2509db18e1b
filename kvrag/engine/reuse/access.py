"""CRAFT's chunk-access table: how often each chunk was retrieved lately, per tenant.

CRAFT (§4.1-4.2) counts each chunk's accesses over a sliding window of the last ``W`` retrievals
(1,000 in the paper), and uses the counts twice:

- **frequency order** (:func:`stored_path_order`): CRAFT sorts a retrieval's chunks by descending
  count so that popular chunks line up as shared prompt prefixes. Counts drift, though, and a
  returning question that already retrieves its chunks in a stored order gets reshuffled (on
  workload (r)'s stream plain count order *lost* prefix hits against retrieval order:
  ``benchmarks/craft_replay.py``). So the order here is tree-aware: the longest chunk sequence
  the namespace holds *exactly* (its stored paths, below) that the retrieval's chunks can form
  goes first (CRAFT's prefix lookup, with prefix slicing: any leading part of a stored path
  counts), then the other chunks by descending count, ties in the order the namespace first
  computed their KV (:meth:`AccessTable.computed`: a request's missed chunks, a warm's stream), so
  that a return's chunks beyond its stored path follow in the order its first ask computed them;
  chunks never computed keep their retrieval order. Where no stored path leads, all ties keep
  retrieval order (CRAFT's stable sort): on a question's first ask the best ranked chunk, the
  likeliest to be retrieved again, leads what gets computed and stored, and a warmed corpus (every
  chunk computed, none in this context) does not reorder a prompt for nothing (ties in the warm's
  order did: an order-only drift of 0.17-0.29 on first asks with no exact chunk gained, docs/journal/issue-36-craft.md;
  ties by content key closed less of the replay's gap, 66% against 81%). With nothing stored it
  is CRAFT's sort;
- **promotion**: a chunk sequence is worth keeping exactly only for its leading run of chunks
  whose counts reach the threshold ``tau`` (:meth:`AccessTable.promoted`); a kept prefix grows by
  its next chunk once that one reaches ``tau`` too.

A retrieval is counted once, whatever the number of LLM calls built from it (LlamaIndex's
``compact`` and ``refine`` make several), and each chunk once per retrieval. Keys are content
ids of the chunk texts (whitespace at the ends ignored: frameworks strip texts when they stuff
them into prompts); a document that may reach a prompt in several forms (LlamaIndex's metadata
header, or none) is recorded under each form, so any form it takes in a prompt finds its count.

**Stored paths**: per namespace, the chunk sequences (chunk keys from the prompt's start) the engine
kept exactly: an exact prefix or exact chunk variants (write-back, the knowledge tree's refresh),
and those a request reused exactly (:meth:`AccessTable.stored`). It is a hint, told when KV is
kept, not when the store evicts it: a stale path costs a worse order (its chunks lead but are
computed), never a wrong answer — the planner checks the store for every chunk as before. It is
bounded (``max_paths`` per namespace, least recently used forgotten first; a path's leading parts
are never forgotten before it).

Tenants (namespaces) have tables of their own: one tenant's traffic never reorders another's
prompts. Everything here is plain Python over strings, thread-safe, testable without a model.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrag.checks import integer
from kvrag.engine.reuse.documents import content_id
from kvrag.errors import InvalidRequestError

__all__ = [
    "CHUNK_ORDERS",
    "AccessStats",
    "AccessTable",
    "check_chunk_order",
    "chunk_key",
    "frequency_order",
    "stored_lead",
    "stored_path_order",
]

#: How a retrieval's chunks are put into the prompt: ``retrieval`` (as the retriever ranked them)
#: or ``frequency`` (CRAFT's, tree-aware: the longest stored path first, then descending access
#: count in the window, ties in retrieval order, or behind a stored path in the order their KV was
#: first computed: :meth:`AccessTable.order`).
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


def frequency_order(counts: Sequence[int], keys: Sequence | None = None) -> list[int]:
    """Indices of a retrieval's chunks by descending count (CRAFT's sort).

    ``counts[i]`` is the count of the chunk ranked ``i`` by the retriever. Equal counts are ordered
    by ``keys[i]`` when given (comparable tie keys, e.g. content keys: the same chunks get the same
    order whatever order they were retrieved in), else kept in retrieval order (Python's sort is stable).
    """
    if keys is None:
        return sorted(range(len(counts)), key=lambda i: -counts[i])
    return sorted(range(len(counts)), key=lambda i: (-counts[i], keys[i], i))


#: Most stored-path lookups one ordering makes (a retrieval of k chunks over a bushy tree could
#: otherwise explore up to k! paths); past it the longest path found so far leads.
MAX_PATH_LOOKUPS = 4096


def stored_lead(keys: Sequence[Sequence[str]], stored: Callable[[tuple[str, ...]], bool]) -> list[int]:
    """Indices of the longest stored chunk sequence a retrieval's chunks can form, in its order.

    Args:
        keys: each chunk's keys (one per form it may take in a prompt), in retrieval order.
        stored: whether a chunk sequence (keys, from the prompt's first chunk) is stored exactly;
            every leading part of a stored sequence must be stored too.

    Depth-first over the chunks in retrieval order, so of equally long paths the one through the
    best ranked chunk wins; at most :data:`MAX_PATH_LOOKUPS` lookups. Empty when no chunk starts a
    stored sequence.
    """
    best: list[int] = []
    budget = [MAX_PATH_LOOKUPS]

    def walk(path: tuple[str, ...], taken: list[int]) -> None:
        nonlocal best
        if len(taken) > len(best):
            best = list(taken)
        for i in range(len(keys)):
            if i in taken or len(best) == len(keys):
                continue
            for key in keys[i]:
                if budget[0] <= 0:
                    return
                budget[0] -= 1
                if stored(path + (key,)):
                    taken.append(i)
                    walk(path + (key,), taken)
                    taken.pop()
                    break

    walk((), [])
    return best


def stored_path_order(
    keys: Sequence[Sequence[str]],
    counts: Sequence[int],
    stored: Callable[[tuple[str, ...]], bool],
    tie: Sequence | None = None,
) -> list[int]:
    """The frequency order, tree-aware: indices of a retrieval's chunks, in the order to prompt them.

    Args:
        keys: each chunk's keys (one per form it may take in a prompt), in retrieval order.
        counts: each chunk's access count in the window.
        stored: whether a chunk sequence is stored exactly (:func:`stored_lead`).
        tie: each chunk's tie key among equal counts (comparable); default its content key (the
            smallest of its keys).

    The longest stored sequence that the retrieval's chunks can form leads (:func:`stored_lead`);
    the other chunks follow by descending count, ties by ``tie``. Pure: the same inputs give the
    same order.
    """
    if tie is None:
        tie = [min(k) if k else "" for k in keys]
    lead = stored_lead(keys, stored)
    taken = set(lead)
    return lead + [i for i in frequency_order(counts, tie) if i not in taken]


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
        stored_paths: chunk sequences known to be stored exactly (each leading part counted).
    """

    window: int | None
    retrievals: int
    recorded: int
    chunks: int
    promoted: int
    threshold: int
    top: tuple[tuple[str, int], ...] = ()
    stored_paths: int = 0


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
        max_paths: stored chunk sequences remembered per namespace (:meth:`stored`; each leading
            part of a sequence is one), least recently used forgotten first.
        max_computed: chunks whose first computation is remembered per namespace (:meth:`computed`),
            the earliest forgotten first.
    """

    def __init__(
        self, window: int | None = 1000, threshold: int = 2, max_paths: int = 10_000, max_computed: int = 100_000
    ) -> None:
        integer(1, also=(None,))("window", window)
        integer(1)("threshold", threshold)
        integer(0)("max_paths", max_paths)
        integer(0)("max_computed", max_computed)
        self.window = window
        self.threshold = threshold
        self.max_paths = max_paths
        self._tables: dict[str, _Window] = {}
        #: per namespace, the stored chunk sequences (key tuples, every leading part present),
        #: least recently used first
        self._paths: dict[str, OrderedDict[tuple[str, ...], None]] = {}
        self.max_computed = max_computed
        #: per namespace, chunk key -> when its KV was first computed (a running number), earliest first
        self._computed: dict[str, OrderedDict[str, int]] = {}
        self._computations: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, namespace: str, documents: Sequence[Document]) -> None:
        """Count one retrieval of ``documents`` in ``namespace`` (each distinct chunk once)."""
        keys = tuple(dict.fromkeys(k for d in documents for k in _keys(d)))
        with self._lock:
            table = self._tables.get(namespace)
            if table is None:
                table = self._tables[namespace] = _Window(self.window)
            table.add(keys)

    def retrieval(self, namespace: str, documents, order: str) -> list[int]:
        """Count one retrieval of ``documents`` (a list, checked) and return their prompt order (``order``:
        ``"retrieval"`` or ``"frequency"``, :meth:`order`): :meth:`kvrag.Engine.record_retrieval`.

        Raises:
            InvalidRequestError: a single string, or a document that is neither a text nor texts.
        """
        order = check_chunk_order(order)
        if isinstance(documents, (str, bytes)):
            raise InvalidRequestError("documents must be a list of texts, not a single string")
        documents = list(documents)
        try:
            ranked = self.order(namespace, documents, order)
            self.record(namespace, documents)
        except TypeError as exc:
            raise InvalidRequestError(str(exc)) from None
        return ranked

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
        keyed = [_keys(d) for d in documents]
        with self._lock:
            table = self._tables.get(namespace)
            counts = [max((table.counts.get(k, 0) for k in ks), default=0) if table else 0 for ks in keyed]
            paths = self._paths.get(namespace)
            lead = stored_lead(keyed, paths.__contains__) if paths else []
            if not lead:  # nothing held exactly to continue: CRAFT's stable sort
                return frequency_order(counts)
            # behind a stored sequence, tied chunks go in the order their KV was first computed
            taken = set(lead)
            ranked = lead + [i for i in frequency_order(counts, self._ties(namespace, keyed)) if i not in taken]
            self._touch(paths, self._lead(paths, [keyed[i] for i in ranked]))
            return ranked

    def _ties(self, namespace: str, keyed: list[tuple[str, ...]]) -> list[tuple]:
        """Tie keys of equal counts behind a stored path: a chunk computed before goes in the order its KV was first
        computed (the earliest of its forms'), ahead of chunks never computed, which keep their
        retrieval order (CRAFT's stable sort; equal tie keys fall back to the retrieval rank)."""
        seen = self._computed.get(namespace) or {}
        ties = []
        for keys in keyed:
            first = [seen[k] for k in keys if k in seen]
            ties.append((0, min(first)) if first else (1, 0))
        return ties

    def computed(self, namespace: str, texts: Sequence[str]) -> None:
        """Tell the table that ``namespace`` computed the KV of the chunks ``texts``, in that order
        (a warm's stream, a request's missed chunks in prompt order). A chunk keeps the number of
        its first computation: the frequency order puts tied chunks in that order, so a chunk follows
        the documents it was computed behind (its context), whoever retrieves it later."""
        if self.max_computed == 0:
            return
        keys = [chunk_key(t) for t in texts]
        with self._lock:
            seen = self._computed.get(namespace)
            if seen is None:
                seen = self._computed[namespace] = OrderedDict()
            n = self._computations.get(namespace, 0)
            for key in keys:
                if key not in seen:
                    seen[key] = n
                    n += 1
            self._computations[namespace] = n
            while len(seen) > self.max_computed:
                seen.popitem(last=False)

    def computation_order(self, namespace: str) -> list[str]:
        """The chunk keys of ``namespace`` in the order their KV was first computed (:meth:`computed`)."""
        with self._lock:
            return list(self._computed.get(namespace, ()))

    @staticmethod
    def _lead(paths: OrderedDict, keyed: list[tuple[str, ...]]) -> tuple[str, ...]:
        """The longest stored path that ``keyed`` (in prompt order) starts with."""
        path: tuple[str, ...] = ()
        for keys in keyed:
            nxt = next((path + (k,) for k in keys if path + (k,) in paths), None)
            if nxt is None:
                break
            path = nxt
        return path

    @staticmethod
    def _touch(paths: OrderedDict, path: tuple[str, ...]) -> None:
        """Mark a path and its leading parts used, the shorter ones last (most recent): a leading part
        is never forgotten before a path that extends it."""
        for n in range(len(path), 0, -1):
            if path[:n] in paths:
                paths.move_to_end(path[:n])

    def stored(self, namespace: str, texts: Sequence[str]) -> None:
        """Remember that ``namespace`` holds the chunk sequence ``texts`` (chunk texts from the prompt's
        first chunk, in order) exactly, and so each of its leading parts (prefix slicing).

        Told when KV is kept or reused exactly; never told of evictions: the frequency order takes
        a path as a hint, and a stale one costs only a worse order.
        """
        path = tuple(chunk_key(t) for t in texts)
        if not path or self.max_paths == 0:
            return
        with self._lock:
            paths = self._paths.get(namespace)
            if paths is None:
                paths = self._paths[namespace] = OrderedDict()
            for n in range(1, len(path) + 1):
                paths.setdefault(path[:n], None)
            self._touch(paths, path)
            while len(paths) > self.max_paths:
                paths.popitem(last=False)  # least recently used; never a leading part of a kept path

    def stored_paths(self, namespace: str) -> list[tuple[str, ...]]:
        """The namespace's stored chunk sequences (key tuples), least recently used first."""
        with self._lock:
            return list(self._paths.get(namespace, ()))

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
                stored_paths=len(self._paths.get(namespace, ())),
            )

    def namespaces(self) -> list[str]:
        with self._lock:
            return list(dict.fromkeys([*self._tables, *self._paths]))

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._paths.clear()
            self._computed.clear()
            self._computations.clear()
