"""Chunk-KV variants (Cache-Craft §3.3) and exact chunk sequences (RAGCache's knowledge tree).

A chunk's KV depends on what it was computed behind. The store may hold several *variants* of a
chunk, each computed in another context; each remembers that context:

- ``context``: the chunks before it when it was computed, in order (short content ids);
- ``exact``: when its KV is exactly what a full prefill computes at that place — every token
  before it was computed exactly, or reused exactly — the digest of all those tokens. A prompt
  whose tokens before the chunk hash to the same digest gets exactly that KV: nothing to recompute.
  Chained over a prompt's chunks this is RAGCache's knowledge tree: the longest stored chunk
  sequence behind the same lead text is reused exactly, and only what follows is blended.
- ``cci`` and ``weights``: Cache-Craft's attention statistics when known (how much the chunk's
  KV depends on what precedes it, and on each preceding chunk).

For a prompt, each variant is scored by Cache-Craft's cache fix overhead
``CFO = CCI * (1 - beta')``: ``beta`` is the share of the variant's context (weighted by its
inter-attention when known) that the prompt also has before the chunk, ``gamma`` the normalised
Kendall-tau distance between the common chunks' two orders, ``beta' = beta * (1 - gamma)``. An
exact variant scores 0. The planner uses the lowest-scoring variant and tells the store
(``record_reuse``), whose eviction weighs each reuse by ``1 / CFO`` (frequency-reuse).

The index of variants lives in memory (:class:`VariantIndex`). The first variant of a chunk is
stored under the chunk's own key, so a restarted process (disk tier) still finds that one; later
variants under derived keys, reached through the index. :class:`StoredVariants` keeps the index
and the store in step: the planner asks it for a chunk's best stored variant, write-back, the warm
and the knowledge tree's refresh ask it to keep one.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.engine.reuse.slices import META_KEY, marked
from kvrag.engine.store.base import KVRecord, KVStore, StoreKey, token_bytes

__all__ = [
    "VariantInfo",
    "VariantIndex",
    "StoredVariants",
    "ExactDigest",
    "context_id",
    "variant_key",
    "variant_slot",
    "prefix_overlap",
    "order_penalty",
    "fix_overhead",
]

#: CCI used for a variant without attention statistics (sigmoid(0): no evidence either way).
DEFAULT_CCI = 0.5


def context_id(token_ids: Sequence[int]) -> str:
    """Short content id of a chunk (its tokens), as variants name their context."""
    return hashlib.sha256(token_bytes(list(token_ids))).hexdigest()[:16]


def variant_key(base: StoreKey, tag: str) -> StoreKey:
    """Key of a chunk variant other than the first (which is stored under ``base`` itself)."""
    return StoreKey(base.namespace, hashlib.sha256(f"{base.digest}\0variant\0{tag}".encode()).hexdigest())


def variant_slot(key: StoreKey, context: tuple[str, ...], exact: str | None) -> StoreKey:
    """Where a variant other than the chunk's first is stored: named by its exact digest or its context."""
    return variant_key(key, f"exact:{exact}" if exact is not None else "context:" + ",".join(context))


class ExactDigest:
    """Running digest of a prompt's tokens: ``at(p)`` names everything before position ``p``."""

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = list(ids)
        self._h = hashlib.sha256(b"kvrag-exact\0")
        self._pos = 0

    def at(self, pos: int) -> str:
        """Digest of tokens [0, pos); positions must be asked in increasing order."""
        if pos < self._pos:
            raise ValueError("ExactDigest positions must not decrease")
        if pos > self._pos:
            self._h.update(token_bytes(self._ids[self._pos : pos]))
            self._pos = pos
        return self._h.copy().hexdigest()


@dataclass(slots=True)
class VariantInfo:
    """What the planner knows of one stored variant of a chunk.

    Attributes:
        key: where the variant's KV is stored.
        context: content ids of the chunks it was computed behind, in order.
        exact: digest of every token before it when its KV is exact for such a prompt, else None.
        cci: Cache-Craft's cache context impact in [0, 1], None if not measured.
        weights: inter-attention share of each context chunk (sums to 1), None if not measured.
        reuses: how often it was used.
    """

    key: StoreKey
    context: tuple[str, ...] = ()
    exact: str | None = None
    cci: float | None = None
    weights: tuple[float, ...] | None = None
    reuses: int = 0

    def meta(self) -> dict:
        """The facts stored in the record's header (JSON), to rebuild this info from a record."""
        out: dict = {"context": list(self.context)}
        if self.exact is not None:
            out["exact"] = self.exact
        if self.cci is not None:
            out["cci"] = self.cci
        if self.weights is not None:
            out["weights"] = list(self.weights)
        return out

    @classmethod
    def from_record(cls, key: StoreKey, record: KVRecord) -> VariantInfo:
        """The info a stored record carries (records from older versions carry none: an unknown context)."""
        return cls.from_meta(key, record.meta)

    @classmethod
    def from_meta(cls, key: StoreKey, meta: dict | None) -> VariantInfo:
        """The info a record's ``meta`` carries (read from its header: :meth:`KVStore.meta`)."""
        meta = meta or {}
        context = meta.get("context")
        context = tuple(str(c) for c in context) if isinstance(context, list) else ()
        exact = meta.get("exact") if isinstance(meta.get("exact"), str) else None
        cci = meta.get("cci")
        cci = float(cci) if isinstance(cci, (int, float)) and 0.0 <= cci <= 1.0 else None
        weights = meta.get("weights")
        if not (isinstance(weights, list) and len(weights) == len(context) and all(_num(w) for w in weights)):
            weights = None
        return cls(key, context, exact, cci, tuple(float(w) for w in weights) if weights else None)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def prefix_overlap(info: VariantInfo, context: Sequence[str]) -> float:
    """Cache-Craft's beta: the share of the variant's context inter-attention the prompt still has before it.

    Uniform weights when the variant has no attention statistics. A variant computed behind
    nothing matches a prompt with nothing before the chunk (1.0) and no other (0.0).
    """
    if not info.context:
        return 1.0 if not context else 0.0
    here = set(context)
    weights = info.weights or (1.0,) * len(info.context)
    total = sum(weights)
    if total <= 0:
        return 0.0
    return sum(w for c, w in zip(info.context, weights) if c in here) / total


def order_penalty(old: Sequence[str], new: Sequence[str]) -> float:
    """Cache-Craft's gamma: normalised Kendall-tau distance between the common chunks' two orders."""
    here = {c: i for i, c in enumerate(new)}
    common = [c for c in dict.fromkeys(old) if c in here]
    m = len(common)
    if m < 2:
        return 0.0
    ranks = [here[c] for c in common]  # the new positions, in the old order
    discordant = sum(1 for i in range(m) for j in range(i + 1, m) if ranks[i] > ranks[j])
    return discordant / (m * (m - 1) / 2)


def fix_overhead(info: VariantInfo, context: Sequence[str], digest: str | None = None) -> float:
    """Cache-Craft's CFO of reusing ``info`` behind ``context`` (without the alpha scale); 0 if exact."""
    if digest is not None and info.exact == digest:
        return 0.0
    beta = prefix_overlap(info, context)
    gamma = order_penalty(info.context, context)
    cci = info.cci if info.cci is not None else DEFAULT_CCI
    return cci * (1.0 - beta * (1.0 - gamma))


class VariantIndex:
    """Chunk key -> its known variants, in memory, bounded. Thread-safe.

    Args:
        max_variants: most variants kept per chunk; adding one more pushes out the least reused.
        max_chunks: most chunks indexed (least recently used forgotten first; their first variant
            stays reachable under the chunk's own key).
    """

    def __init__(self, max_variants: int = 4, max_chunks: int = 200_000) -> None:
        self.max_variants = max_variants
        self.max_chunks = max_chunks
        self._by_chunk: OrderedDict[StoreKey, list[VariantInfo]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_chunk)

    def keys(self, base: StoreKey) -> list[StoreKey]:
        """The store keys of a chunk's indexed variants (a peek: the index's order is untouched)."""
        with self._lock:
            return [v.key for v in self._by_chunk.get(base, ())]

    def variants(self, base: StoreKey) -> list[VariantInfo]:
        with self._lock:
            found = self._by_chunk.get(base)
            if found is None:
                return []
            self._by_chunk.move_to_end(base)
            return list(found)

    def add(self, base: StoreKey, info: VariantInfo) -> list[StoreKey]:
        """Index a variant (replacing one with the same key); returns the keys it pushed out."""
        with self._lock:
            found = [v for v in self._by_chunk.get(base, []) if v.key != info.key]
            found.append(info)
            dropped = []
            while len(found) > self.max_variants:
                worst = min(found[:-1], key=lambda v: v.reuses)  # never the one just added
                found.remove(worst)
                dropped.append(worst.key)
            self._by_chunk[base] = found
            self._by_chunk.move_to_end(base)
            while len(self._by_chunk) > self.max_chunks:
                self._by_chunk.popitem(last=False)
            return dropped

    def drop(self, base: StoreKey, key: StoreKey) -> None:
        """Forget a variant (its entry is gone from the store)."""
        with self._lock:
            found = self._by_chunk.get(base)
            if found is None:
                return
            found[:] = [v for v in found if v.key != key]
            if not found:
                del self._by_chunk[base]

    def used(self, info: VariantInfo) -> None:
        with self._lock:
            info.reuses += 1

    def clear(self) -> None:
        with self._lock:
            self._by_chunk.clear()


class StoredVariants:
    """The variants of each chunk that the store holds, as the index knows them.

    The index is a hint: the store may have evicted a variant it lists (forgotten when met), and
    may hold variants it does not list (kept by an earlier process on a disk or shared tier; indexed
    from their headers when met). Every answer here is checked against the store.

    Args:
        store: where the variants' KV lives.
        index: what is known of each chunk's variants (context, exact digest, statistics, reuses).
        kv_shape: (layers, KV heads, head dim) of the model: a record of another shape is refused
            (only a forged entry has one; its tokens and key match, its KV cannot be placed).
    """

    def __init__(self, store: KVStore, index: VariantIndex, kv_shape: tuple[int, int, int]) -> None:
        self.store = store
        self.index = index
        self.kv_shape = tuple(kv_shape)

    def fits(self, record: KVRecord) -> bool:
        """Whether a record's KV has this model's shape."""
        return record.kv_shape == self.kv_shape

    def best(
        self, key: StoreKey, ids: list[int], context: tuple[str, ...], digest: str | None, *, quiet: bool = False
    ) -> tuple[VariantInfo | None, KVRecord | None]:
        """The stored variant of a chunk with the lowest fix overhead behind ``context`` (an exact one
        first), read as a use (``store.get``; ``quiet``: as a look, ``store.peek``).

        Variants the store no longer has are dropped from the index on the way; with none indexed,
        the chunk's own key may still hold its first variant (a disk tier after a restart).
        """
        # an exact variant first: one computed behind the same chunks (not exactly the same tokens) scores 0 too
        ranked = sorted(
            self.index.variants(key),
            key=lambda v: (fix_overhead(v, context, digest), v.exact is None or v.exact != digest, -v.reuses),
        )
        fetch = self.store.peek if quiet else self.store.get
        info, rec = self._first_stored(key, ids, ranked, fetch)
        if rec is not None:
            return info, rec
        rec = fetch(key, ids)
        if rec is None or not self.fits(rec):
            return None, None
        info = VariantInfo.from_record(key, rec)
        self.index.add(key, info)
        return info, rec

    def exact(self, key: StoreKey, ids: list[int], digest: str) -> tuple[VariantInfo | None, KVRecord | None]:
        """The chunk's variant computed exactly behind the tokens ``digest`` names, if stored, read as
        a look (``store.peek``): only the refresh's plans (``exact_only``) ask for it."""
        exact = [v for v in self.index.variants(key) if v.exact == digest]
        return self._first_stored(key, ids, exact, self.store.peek)

    def _first_stored(
        self, key: StoreKey, ids: list[int], ranked: list[VariantInfo], fetch
    ) -> tuple[VariantInfo | None, KVRecord | None]:
        """The first of ``ranked`` whose record the store still has, read by ``fetch`` (the others are
        dropped from the index)."""
        for info in ranked:
            rec = fetch(info.key, ids)
            if rec is not None and self.fits(rec):
                return info, rec
            self.index.drop(key, info.key)
        return None, None

    def used(self, info: VariantInfo, fix: float) -> None:
        """A request reuses the variant at fix overhead ``fix``: counted in the index, and told to the
        store, whose eviction weighs each reuse by ``1 / fix`` (frequency-reuse)."""
        self.index.used(info)
        self.store.record_reuse(info.key, fix)

    def keep(
        self,
        key: StoreKey,
        record: KVRecord,
        context: tuple[str, ...],
        exact: str | None = None,
        *,
        speculative: bool = False,
    ) -> bool:
        """Store ``record`` as a variant of the chunk whose own key is ``key``; False if not kept.

        The first variant goes under ``key`` itself, later ones under keys derived from their
        context (the same context, or the same exact digest, is kept once). Past the per-chunk cap
        the least reused variant leaves the store. The record's meta keeps the context (and its
        attention statistics, when measured) so the variant can be scored again from the record.
        ``speculative``: kept ahead of any request for it: not kept when the chunk is at the cap (it
        pushes out no variant), and the store's ``put`` gives it no room a request's entry holds and
        evicts it first until it is used. An exact record computed in fixed slices (its meta marked:
        :mod:`kvrag.engine.reuse.slices`) replaces the variant exact behind the same tokens kept
        without that mark.
        """
        record.meta = {**record.meta, "context": list(context)}
        if exact is not None:
            record.meta["exact"] = exact
            if META_KEY in record.meta:
                self._drop_unmarked(key, exact, record.meta[META_KEY][0])
        slot = key
        if self.store.contains(key):  # the chunk has a first variant: make sure the index knows it
            self._indexed(key, key)
            slot = variant_slot(key, context, exact)
            first_exact = exact is not None and any(v.key == key and v.exact == exact for v in self.index.variants(key))
            if self.store.contains(slot) or first_exact:  # kept once: the first variant may be that exact one
                return False
            if speculative and not self.room(key):
                return False  # a variant kept ahead of need never pushes out one a request kept
        if not self.store.put(slot, record, speculative=speculative):
            return False
        for old in self.index.add(key, VariantInfo.from_record(slot, record)):
            self.store.remove(old)
        return True

    def _drop_unmarked(self, key: StoreKey, exact: str, slice_tokens: int) -> None:
        """Remove the chunk's variants exact behind the tokens ``exact`` names that were not computed in
        slices of ``slice_tokens`` (a variant so computed takes their place)."""
        if self.store.contains(key):
            self._indexed(key, key)
        for info in self.index.variants(key):
            if info.exact == exact and not marked(self.store.meta(info.key), slice_tokens):
                self.store.remove(info.key)
                self.index.drop(key, info.key)

    def holds_exact(self, key: StoreKey, exact: str) -> bool:
        """Whether the index knows a variant of the chunk exact behind the tokens ``exact`` names (a
        variant computed there again replaces it: it needs no room)."""
        return any(v.exact == exact for v in self.index.variants(key))

    def _indexed(self, key: StoreKey, slot: StoreKey) -> bool:
        """Whether the index knows variant ``slot`` of the chunk whose own key is ``key``; one the
        store holds but the index does not know (kept by an earlier process: a disk or shared tier)
        is indexed from its header (a look, not a use)."""
        if any(v.key == slot for v in self.index.variants(key)):
            return True
        meta = self.store.meta(slot)
        if meta is None:
            return False
        self.index.add(key, VariantInfo.from_meta(slot, meta))
        return True

    def wants(self, key: StoreKey, context: Sequence[str], wanted: int) -> bool:
        """Whether a warm should compute the chunk's variant behind ``context``: the chunk has fewer
        than ``wanted`` variants and none stored behind that context. One the store holds but the
        index does not know is indexed instead, after the first variant, so a restarted engine's
        warm finds its variants again unrecomputed."""
        if len(self.index.keys(key)) >= wanted:
            return False
        self._indexed(key, key)
        return not self._indexed(key, variant_slot(key, tuple(context), None))

    def room(self, key: StoreKey) -> bool:
        """Whether the chunk has fewer variants than the cap (those the store lost are forgotten first)."""
        for k in self.index.keys(key):
            if not self.store.contains(k):
                self.index.drop(key, k)
        return len(self.index.keys(key)) < self.index.max_variants

    def holds(self, key: StoreKey) -> bool:
        """Whether the store holds a variant of the chunk whose own key is ``key`` (key lookups only)."""
        return self.store.contains(key) or any(self.store.contains(k) for k in self.index.keys(key))
