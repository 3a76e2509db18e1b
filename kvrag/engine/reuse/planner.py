"""From a request's segments to a prefill plan: tokens, cache lookups, what to compute.

Each segment is tokenised on its own (a chunk's tokens are the same wherever it appears). Chunks
are looked up by key (model fingerprint + token ids, verified on hit); the longest exact prefix is
looked up in the prefix cache. The plan says which positions hold cached KV, which of those are
candidates for HKVD recompute, and which must be computed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvrag.engine.model.adapter import ModelAdapter, RopeTable
from kvrag.engine.model.runner import KVBuffer
from kvrag.engine.reuse.prefix import PrefixCache
from kvrag.engine.reuse.variants import ExactDigest, VariantIndex, VariantInfo, context_id, fix_overhead, variant_key
from kvrag.engine.store.base import KVRecord, KVStore, StoreKey, chunk_key
from kvrag.kernels import rope_rotate

__all__ = ["Segment", "ChunkUse", "Plan", "Planner", "SpanSource", "reuses_nothing"]


@dataclass(slots=True)
class Segment:
    """A piece of the prompt: ``text`` (always computed) or ``chunk`` (a cacheable document)."""

    kind: str
    text: str
    ids: list[int] = field(default_factory=list)
    start: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


@dataclass(slots=True)
class ChunkUse:
    """What happened to one chunk of a request."""

    index: int  # segment index
    start: int
    length: int
    key: StoreKey  # the chunk's own key (its first variant's)
    hit: bool
    source: str  # "store" (blended), "tree" (an exact variant), "prefix" (inside an exact prefix), "computed"
    tier: str = ""  # for "store"/"tree": the tier the KV came from ("memory", "disk", ...)
    context: tuple[str, ...] = ()  # content ids of the chunks before it in this prompt
    digest: str | None = None  # digest of every token before it (see kvrag.engine.reuse.variants)
    fix: float | None = None  # the used variant's cache fix overhead (Cache-Craft's CFO without alpha)


def reuses_nothing(mode: str, ratio: float | str, auto: bool = False) -> bool:
    """Every token is computed: ``full`` mode, or ``blend`` at a fixed ratio of 1.0 (with ``auto``,
    or the ratio ``"auto"``, the ratio is a cap and reuse may still happen)."""
    return mode == "full" or (mode == "blend" and not auto and not isinstance(ratio, str) and ratio >= 1.0)


@dataclass(slots=True)
class Plan:
    """A prefill plan for one request."""

    mode: str
    ratio: float  # the recompute budget's share of blended tokens (with ``auto``: its cap)
    segments: list[Segment]
    ids: torch.Tensor  # [N]
    namespace: str = "default"  # the tenant whose cache entries the plan uses
    auto: bool = False  # recompute what the selection measures is needed, up to ``ratio``
    prefix_len: int = 0  # [0, prefix_len) reused exactly from the prefix cache
    prefix_records: list[tuple[int, KVRecord]] = field(default_factory=list)
    chunk_records: list[tuple[int, KVRecord]] = field(default_factory=list)  # (start, record) of blended hits
    exact_records: list[tuple[int, KVRecord]] = field(default_factory=list)  # (start, record) of exact variants
    chunks: list[ChunkUse] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def is_full(self) -> bool:
        """Every token is computed, nothing reused (:func:`reuses_nothing`)."""
        return reuses_nothing(self.mode, self.ratio, self.auto)

    @property
    def boundaries(self) -> list[int]:
        return [s.end for s in self.segments]

    @property
    def cached_tokens(self) -> int:
        return self.prefix_len + sum(r.num_tokens for _, r in self.chunk_records + self.exact_records)

    @property
    def exact_tokens(self) -> int:
        """Prompt tokens whose KV is reused exactly: the exact prefix and exact chunk variants."""
        return self.prefix_len + sum(r.num_tokens for _, r in self.exact_records)

    def cached_spans(self) -> list[tuple[int, KVRecord]]:
        """Every (start, record) the prefill places: prefix blocks, exact variants, blended hits."""
        return self.prefix_records + self.exact_records + self.chunk_records

    def reused_exactly(self) -> torch.Tensor:
        """[N] bool: positions whose KV is reused exactly (the exact prefix, exact chunk variants)."""
        mask = torch.zeros(self.num_tokens, dtype=torch.bool)
        mask[: self.prefix_len] = True
        for start, rec in self.exact_records:
            mask[start : start + rec.num_tokens] = True
        return mask

    def candidates(self) -> torch.Tensor:
        """[N] bool: positions holding blended cached chunk KV (what a selection may recompute)."""
        mask = torch.zeros(self.num_tokens, dtype=torch.bool)
        for start, rec in self.chunk_records:
            mask[start : start + rec.num_tokens] = True
        return mask

    def exact_end(self) -> int:
        """Positions [0, exact_end) get exact KV (the first blended chunk starts the approximation)."""
        return min((s for s, _ in self.chunk_records), default=self.num_tokens)

    def first_chunk_start(self) -> int:
        return min((s.start for s in self.segments if s.kind == "chunk"), default=self.num_tokens)


class SpanSource:
    """Cached KV of a plan (prefix blocks and chunk hits), placed layer by layer at its positions.

    Stored keys carry no RoPE; each layer's keys are rotated with that layer's own RoPE (Gemma 3's
    local and global layers differ).
    """

    def __init__(self, adapter: ModelAdapter, spans: list[tuple[int, KVRecord]], rope: RopeTable):
        self.adapter = adapter
        self.spans = spans
        self.rope = rope  # cos/sin [N, D] of every position of the prompt, per layer

    def fill(self, layer: int, buf: KVBuffer) -> None:
        dtype = self.adapter.dtype
        cos, sin = self.rope.layer(layer)
        for start, rec in self.spans:
            end = start + rec.num_tokens
            k, v = rec.layer(layer)  # a record streaming in from disk waits for this layer only
            buf.k[layer, :, start:end] = rope_rotate(k.to(dtype), cos[start:end], sin[start:end])
            buf.v[layer, :, start:end] = v.to(dtype)


class Planner:
    """Tokenises segments and looks up cached KV for them."""

    def __init__(
        self,
        tokenizer,
        store: KVStore,
        fingerprint: str,
        namespace: str,
        block: int,
        context_label: str,
        variants: VariantIndex | None = None,
    ):
        self.tokenizer = tokenizer
        self.store = store
        self.fingerprint = fingerprint
        self.namespace = namespace  # the default tenant; a request may name another
        self.prefix_cache = PrefixCache(store, fingerprint, block)
        self.kv_shape: tuple[int, int, int] | None = None  # (layers, KV heads, head dim) of the model
        self.context_label = context_label  # how chunk KV was computed (part of every chunk key)
        self.variants = variants if variants is not None else VariantIndex()
        self._tok_cache: OrderedDict[str, list[int]] = OrderedDict()
        self._tok_lock = threading.Lock()  # callers' threads tokenise their requests at once
        bos = getattr(tokenizer, "bos_token_id", None)
        with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        self.bos_id = bos if bos is not None and len(with_special) > len(plain) and with_special[0] == bos else None

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text on its own (no special tokens added), memoised (thread-safe)."""
        with self._tok_lock:
            ids = self._tok_cache.get(text)
            if ids is not None:
                self._tok_cache.move_to_end(text)
                return ids
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        with self._tok_lock:
            self._tok_cache[text] = ids
            if len(self._tok_cache) > 4096:
                self._tok_cache.popitem(last=False)
        return ids

    def _best_variant(
        self, key: StoreKey, ids: list[int], context: tuple[str, ...], digest: str | None
    ) -> tuple[VariantInfo | None, KVRecord | None]:
        """The stored variant of a chunk with the lowest fix overhead here (an exact one first).

        Variants the store no longer has are dropped from the index on the way; with none indexed,
        the chunk's own key may still hold its first variant (a disk tier after a restart).
        """
        # an exact variant first: one computed behind the same chunks (not exactly the same tokens) scores 0 too
        ranked = sorted(
            self.variants.variants(key),
            key=lambda v: (fix_overhead(v, context, digest), v.exact is None or v.exact != digest, -v.reuses),
        )
        info, rec = self._first_stored(key, ids, ranked)
        if rec is not None:
            return info, rec
        rec = self.store.get(key, ids)
        if rec is None or not self._fits(rec):
            return None, None
        info = VariantInfo.from_record(key, rec)
        self.variants.add(key, info)
        return info, rec

    def _exact_variant(self, key: StoreKey, ids: list[int], digest: str) -> tuple[VariantInfo | None, KVRecord | None]:
        """The chunk's variant computed exactly behind the tokens ``digest`` names, if stored, read as
        a look (``store.peek``): only the refresh's plans (``exact_only``) ask for it."""
        return self._first_stored(
            key, ids, [v for v in self.variants.variants(key) if v.exact == digest], fetch=self.store.peek
        )

    def _first_stored(
        self, key: StoreKey, ids: list[int], ranked: list[VariantInfo], fetch=None
    ) -> tuple[VariantInfo | None, KVRecord | None]:
        """The first of ``ranked`` whose record the store still has (the others are dropped from the
        index), read by ``fetch`` (default ``store.get``)."""
        fetch = fetch or self.store.get
        for info in ranked:
            rec = fetch(info.key, ids)
            if rec is not None and self._fits(rec):
                return info, rec
            self.variants.drop(key, info.key)
        return None, None

    def keep_variant(
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
        evicts it first until it is used.
        """
        record.meta = {**record.meta, "context": list(context)}
        if exact is not None:
            record.meta["exact"] = exact
        slot = key
        if self.store.contains(key):  # the chunk has a first variant: make sure the index knows it
            self._indexed(key, key)
            slot = _slot(key, context, exact)
            if self.store.contains(slot):
                return False
            if speculative and not self.room_for_variant(key):
                return False  # a variant kept ahead of need never pushes out one a request kept
        if not self.store.put(slot, record, speculative=speculative):
            return False
        for old in self.variants.add(key, VariantInfo.from_record(slot, record)):
            self.store.remove(old)
        return True

    def _indexed(self, key: StoreKey, slot: StoreKey) -> bool:
        """Whether the index knows variant ``slot`` of the chunk whose own key is ``key``; one the
        store holds but the index does not know (kept by an earlier process: a disk or shared tier)
        is indexed from its header (a look, not a use)."""
        if any(v.key == slot for v in self.variants.variants(key)):
            return True
        meta = self.store.meta(slot)
        if meta is None:
            return False
        self.variants.add(key, VariantInfo.from_meta(slot, meta))
        return True

    def wants_variant(self, key: StoreKey, context: Sequence[str], wanted: int) -> bool:
        """Whether a warm should compute the chunk's variant behind ``context``: the chunk has fewer
        than ``wanted`` variants and none stored behind that context. One the store holds but the
        index does not know is indexed instead, after the first variant, so a restarted engine's
        warm finds its variants again unrecomputed."""
        if len(self.variants.keys(key)) >= wanted:
            return False
        self._indexed(key, key)
        return not self._indexed(key, _slot(key, tuple(context), None))

    def room_for_variant(self, key: StoreKey) -> bool:
        """Whether the chunk has fewer variants than the cap (those the store lost are forgotten first)."""
        for k in self.variants.keys(key):
            if not self.store.contains(k):
                self.variants.drop(key, k)
        return len(self.variants.keys(key)) < self.variants.max_variants

    def _fits(self, rec) -> bool:
        """A record whose KV has another model's shape is unusable (only a forged entry has one)."""
        return self.kv_shape is None or rec.kv_shape == self.kv_shape

    def holds(self, key: StoreKey) -> bool:
        """Whether the store holds a variant of the chunk whose own key is ``key`` (key lookups only)."""
        return self.store.contains(key) or any(self.store.contains(k) for k in self.variants.keys(key))

    def chunk_key(self, ids: list[int], namespace: str | None = None) -> StoreKey:
        """Key of a chunk's KV for a tenant (default: the engine's namespace)."""
        return chunk_key(namespace or self.namespace, self.fingerprint, ids, context=self.context_label)

    def segment(self, parts: list[tuple[str, str]]) -> tuple[list[Segment], torch.Tensor]:
        """Tokenise (kind, text) parts into positioned segments; empty parts are dropped."""
        segments: list[Segment] = []
        pos = 0
        if self.bos_id is not None:
            first = next((t for _, t in parts if t), "")
            if not first.startswith(self.tokenizer.bos_token or "\0"):
                segments.append(Segment("text", self.tokenizer.bos_token, [self.bos_id], 0))
                pos = 1
        for kind, text in parts:
            if not text:
                continue
            ids = self.tokenize(text)
            if not ids:
                continue
            segments.append(Segment(kind, text, ids, pos))
            pos += len(ids)
        all_ids = [t for s in segments for t in s.ids]
        return segments, torch.tensor(all_ids, dtype=torch.long)

    def plan(
        self,
        segments: list[Segment],
        ids: torch.Tensor,
        *,
        mode: str,
        ratio: float,
        use_prefix: bool,
        namespace: str | None = None,
        auto: bool = False,
        exact_only: bool = False,
    ) -> Plan:
        """What to reuse and what to compute for a tenant's (``namespace``, default the engine's) prompt.

        ``exact_only`` (with ``mode="prefix"``) also reuses exact chunk variants, and nothing blended:
        its prefill computes exactly what a full prefill does (the knowledge tree's refresh). Its
        lookups are looks, not uses (:meth:`~kvrag.engine.store.base.KVStore.peek`): no hit counted,
        no rank touched, a speculative entry still unused.
        """
        namespace = namespace or self.namespace
        plan = Plan(mode=mode, ratio=ratio, segments=segments, ids=ids, namespace=namespace, auto=auto)
        id_list = ids.tolist()
        if plan.is_full:
            for i, s in enumerate(segments):
                if s.kind == "chunk":
                    key = self.chunk_key(s.ids, namespace)
                    plan.chunks.append(ChunkUse(i, s.start, len(s.ids), key, False, "computed"))
            return plan
        limit = len(id_list) - 1  # the last token is always computed: its logits start decoding
        if use_prefix:
            plan.prefix_len, plan.prefix_records = self.prefix_cache.lookup(
                id_list, plan.boundaries, limit, namespace=namespace, quiet=exact_only
            )
            bad = next((i for i, (_, r) in enumerate(plan.prefix_records) if not self._fits(r)), None)
            if bad is not None:
                plan.prefix_len = plan.prefix_records[bad][0]
                plan.prefix_records = plan.prefix_records[:bad]
        exact = ExactDigest(id_list)
        before: list[str] = []  # content ids of the chunks so far
        for i, s in enumerate(segments):
            if s.kind != "chunk":
                continue
            key = self.chunk_key(s.ids, namespace)
            use = ChunkUse(i, s.start, len(s.ids), key, False, "computed", context=tuple(before))
            plan.chunks.append(use)
            before.append(context_id(s.ids))
            if s.end <= plan.prefix_len:
                use.hit, use.source = True, "prefix"
                continue
            if s.start < plan.prefix_len:
                continue
            use.digest = exact.at(s.start)
            if not (exact_only or mode in ("blend", "reuse")) or s.end > limit:  # the last token is always computed
                continue
            if exact_only:
                info, rec = self._exact_variant(key, s.ids, use.digest)
            else:
                info, rec = self._best_variant(key, s.ids, use.context, use.digest)
            if rec is None:
                continue
            use.hit, use.tier, use.fix = True, rec.tier, fix_overhead(info, use.context, use.digest)
            if info.exact is not None and info.exact == use.digest:
                use.source = "tree"
                plan.exact_records.append((s.start, rec))
            else:
                use.source = "store"
                plan.chunk_records.append((s.start, rec))
            if not exact_only:  # a refresh is not a use
                self.variants.used(info)
                self.store.record_reuse(info.key, use.fix)
        return plan


def _slot(key: StoreKey, context: tuple[str, ...], exact: str | None) -> StoreKey:
    """Where a variant other than the chunk's first is stored: named by its exact digest or its context."""
    return variant_key(key, f"exact:{exact}" if exact is not None else "context:" + ",".join(context))
