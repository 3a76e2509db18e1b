"""The prompt's document finder: finding known document texts inside a rendered prompt.

Integrations record the text of every retrieved document here (keyed by content hash). When a
prompt arrives as one string (a chat template rendered by LangChain or LlamaIndex), the segmenter
finds the registered texts in it, wherever they are and whatever surrounds them, and splits the
prompt into ``text, chunk, text, chunk, ..., text``. Nothing is required of the prompt: text that
matches no document is simply computed.

Matching: every registered text is indexed by a hash of its first ``anchor`` characters; the
prompt is scanned with a rolling hash of the same width, and candidate positions are verified
with a plain string comparison. Leftmost, then longest, non-overlapping matches win. A lookup
costs O(prompt) whatever the number of texts: it reads the index in place, without copying it
(``python -m benchmarks registry`` measures it at 100 and 100,000 texts).

Bounded work however many texts begin alike (a corpus whose texts all open with
``"Source: https://en.wikipedia.org/wiki/"``, or an attacker's): an anchor's bucket holds at most
:data:`MAX_PER_ANCHOR` texts; past that it splits by a hash of twice as many leading characters,
and so on (texts shorter than the split's width stay in the bucket, at most
:data:`MAX_PER_ANCHOR` of them, the least recently registered forgotten first). Registering a text
costs O(its length + :data:`MAX_PER_ANCHOR`) per level, with at most log2(length / anchor) levels,
and a candidate position at most :data:`MAX_PER_ANCHOR` comparisons per level.

**Tenants.** Each namespace has its own texts and index: a prompt of tenant B is split only at
texts B registered, so nothing B sees (its split, its chunk hits and misses, its answer) depends on
what another tenant registered. The ``max_entries`` bound is shared by the fair rule
(:mod:`kvrag.engine.store.tenants`): past it, the tenant holding the most texts (the registering
one on a tie) forgets its oldest, so a tenant registering more than any other pushes out only its
own texts.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict

from kvrag.engine.store.tenants import fair_victim

__all__ = ["DocumentFinder", "content_id", "MAX_PER_ANCHOR"]

#: Most texts in one bucket of the anchor index before it splits by a longer prefix (and most texts
#: shorter than that prefix kept in it: the least recently registered forgotten first).
MAX_PER_ANCHOR = 16


_BASE = 257
_MOD = (1 << 61) - 1


def content_id(text: str) -> str:
    """Content hash of a document text (hex SHA-256, 32 chars)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _hash(s: str) -> int:
    h = 0
    for ch in s:
        h = (h * _BASE + ord(ch)) % _MOD
    return h


class _Bucket:
    """Texts that begin alike: all share their first ``width`` characters (by hash). Until it splits,
    ``texts`` holds them; once split, ``texts`` holds only those shorter than ``2 x width`` and
    ``children`` the others by a hash of their first ``2 x width`` characters.

    Written only under the finder's lock; ``texts`` is replaced, never mutated, and ``children`` is
    only read by key, so :meth:`DocumentFinder.find` reads buckets without the lock."""

    __slots__ = ("width", "texts", "children")

    def __init__(self, width: int, texts: tuple[str, ...] = ()) -> None:
        self.width = width
        self.texts = texts  # least recently registered first
        self.children: dict[int, _Bucket] | None = None

    def add(self, text: str) -> str | None:
        """Index ``text`` (registered again: made the most recent); the text this forgets, or None."""
        bucket = self
        while bucket.children is not None and len(text) >= 2 * bucket.width:
            width = 2 * bucket.width
            h = hash(text[:width])
            child = bucket.children.get(h)
            if child is None:
                child = bucket.children[h] = _Bucket(width)
            bucket = child
        bucket.texts = tuple(t for t in bucket.texts if t != text) + (text,)
        if len(bucket.texts) <= MAX_PER_ANCHOR:
            return None
        if bucket.children is None:
            return bucket._split()
        return bucket._drop_oldest()

    def _split(self) -> str | None:
        """Split a full bucket by a longer prefix (built whole, then published); the short text past
        the bound it forgets, or None."""
        width = 2 * self.width
        children: dict[int, _Bucket] = {}
        short = []
        for t in self.texts:
            if len(t) >= width:
                child = children.setdefault(hash(t[:width]), _Bucket(width))
                child.texts += (t,)
            else:
                short.append(t)
        forgotten = None
        for child in children.values():  # texts alike for longer still: split again
            if len(child.texts) > MAX_PER_ANCHOR:
                forgotten = child._split()
        self.children = children
        self.texts = tuple(short)
        if len(short) > MAX_PER_ANCHOR:
            forgotten = self._drop_oldest()
        return forgotten

    def _drop_oldest(self) -> str:
        """Forget the least recently registered of the texts kept here."""
        forgotten, self.texts = self.texts[0], self.texts[1:]
        return forgotten

    def remove(self, text: str) -> bool:
        """Drop ``text`` from the index; whether the bucket is now empty."""
        path = [self]
        while path[-1].children is not None and len(text) >= 2 * path[-1].width:
            child = path[-1].children.get(hash(text[: 2 * path[-1].width]))
            if child is None:
                break
            path.append(child)
        path[-1].texts = tuple(t for t in path[-1].texts if t != text)
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:])):
            if child.texts or child.children:
                break
            parent.children.pop(hash(text[: child.width]), None)
        return not self.texts and not self.children

    def longest(self, prompt: str, i: int) -> int:
        """Length of the longest indexed text that ``prompt`` holds at ``i`` (0 if none)."""
        best, bucket, n = 0, self, len(prompt)
        while bucket is not None:
            for t in bucket.texts:
                if len(t) > best and prompt.startswith(t, i):
                    best = len(t)
            children = bucket.children
            width = 2 * bucket.width
            bucket = children.get(hash(prompt[i : i + width])) if children is not None and i + width <= n else None
        return best


class _Tenant:
    """One namespace's texts and anchor index."""

    __slots__ = ("texts", "by_anchor")

    def __init__(self) -> None:
        self.texts: OrderedDict[str, str] = OrderedDict()  # id -> text, oldest first; under the lock
        # anchor hash -> the bucket of registered texts that start with it. Written only under the
        # lock; find() reads it without the lock (a dict lookup is atomic, under the GIL and in
        # free-threaded builds alike; see _Bucket).
        self.by_anchor: dict[int, _Bucket] = {}


class DocumentFinder:
    """Bounded, thread-safe sets of document texts per tenant, searchable inside prompts.

    Args:
        max_entries: most recently registered texts kept, all tenants together (past it, the tenant
            holding the most forgets its oldest).
        min_chars: texts shorter than this are not registered (not worth caching).
        anchor: characters hashed to find candidate positions (must be <= min_chars).
        namespace: the tenant of calls that name none (the engine's ``EngineConfig.namespace``).
    """

    def __init__(
        self, max_entries: int = 100_000, min_chars: int = 32, anchor: int = 32, *, namespace: str = "default"
    ) -> None:
        if anchor > min_chars:
            raise ValueError("anchor must be <= min_chars")
        self.max_entries = max_entries
        self.min_chars = min_chars
        self.anchor = anchor
        self.namespace = namespace
        self._tenants: dict[str, _Tenant] = {}
        self._held: Counter[str] = Counter()  # namespace -> its texts
        self._total = 0
        self._lock = threading.Lock()
        self._pow = pow(_BASE, anchor - 1, _MOD)

    def __len__(self) -> int:
        return self._total

    def __contains__(self, text: str) -> bool:
        return self.holds(text)

    def holds(self, text: str, namespace: str | None = None) -> bool:
        """Whether ``namespace`` registered ``text`` (and has not forgotten it)."""
        tenant = self._tenants.get(self.namespace if namespace is None else namespace)
        return tenant is not None and content_id(text) in tenant.texts

    def count(self, namespace: str | None = None) -> int:
        """Texts ``namespace`` holds."""
        return self._held.get(self.namespace if namespace is None else namespace, 0)

    def register(self, texts, namespace: str | None = None) -> list[str]:
        """Record texts for tenant ``namespace``; returns their content ids (texts too short are
        skipped, id still given)."""
        namespace = self.namespace if namespace is None else namespace
        ids = []
        with self._lock:
            for text in texts:
                if not isinstance(text, str):
                    raise TypeError(f"documents must be strings, got {type(text).__name__}")
                cid = content_id(text)
                ids.append(cid)
                if len(text) < self.min_chars:
                    continue
                tenant = self._tenants.get(namespace)
                new = tenant is None or cid not in tenant.texts
                if not new:
                    tenant.texts.move_to_end(cid)
                while new and self._total and self._total >= self.max_entries:  # room first: never the new text
                    victim = fair_victim(self._held, namespace, 1)
                    self._forget(victim, next(iter(self._tenants[victim].texts)))
                tenant = self._tenants.get(namespace)
                if tenant is None:
                    tenant = self._tenants[namespace] = _Tenant()
                h = _hash(text[: self.anchor])
                bucket = tenant.by_anchor.get(h)
                if bucket is None:
                    bucket = tenant.by_anchor[h] = _Bucket(self.anchor)
                if new:
                    tenant.texts[cid] = text
                    self._held[namespace] += 1
                    self._total += 1
                forgotten = bucket.add(text)
                if forgotten is not None:
                    self._forget(namespace, content_id(forgotten), indexed=False)
        return ids

    def _forget(self, namespace: str, cid: str, *, indexed: bool = True) -> None:
        """Drop a tenant's text (the lock held); ``indexed=False``: the index dropped it already."""
        tenant = self._tenants[namespace]
        old = tenant.texts.pop(cid)
        if indexed:
            h = _hash(old[: self.anchor])
            if tenant.by_anchor[h].remove(old):
                del tenant.by_anchor[h]
        self._total -= 1
        self._held[namespace] -= 1
        if self._held[namespace] <= 0:
            del self._held[namespace]
            del self._tenants[namespace]

    def find(self, prompt: str, namespace: str | None = None) -> list[tuple[int, int]]:
        """Non-overlapping (start, end) character spans of ``namespace``'s texts inside ``prompt``."""
        w = self.anchor
        n = len(prompt)
        tenant = self._tenants.get(self.namespace if namespace is None else namespace)
        by_anchor = tenant.by_anchor if tenant is not None else None  # read in place, without the lock
        if n < w or not by_anchor:
            return []
        spans: list[tuple[int, int]] = []
        h = _hash(prompt[:w])
        i = 0
        next_free = 0
        while True:
            if i >= next_free:
                bucket = by_anchor.get(h)
                if bucket is not None:
                    best = bucket.longest(prompt, i)
                    if best:
                        spans.append((i, i + best))
                        next_free = i + best
            if i + w >= n:
                break
            h = ((h - ord(prompt[i]) * self._pow) * _BASE + ord(prompt[i + w])) % _MOD
            i += 1
        return spans

    def split(self, prompt: str, namespace: str | None = None) -> list[tuple[str, str]]:
        """The prompt as (kind, text) parts: ``text`` and ``chunk`` alternating as found (``namespace``'s texts)."""
        parts: list[tuple[str, str]] = []
        pos = 0
        for start, end in self.find(prompt, namespace):
            if start > pos:
                parts.append(("text", prompt[pos:start]))
            parts.append(("chunk", prompt[start:end]))
            pos = end
        if pos < len(prompt):
            parts.append(("text", prompt[pos:]))
        return parts
