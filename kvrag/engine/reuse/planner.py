"""From a request's segments to a prefill plan: what to reuse, what to compute.

The planner only decides. From the prompt's segments (token ids: :mod:`~kvrag.engine.reuse.segments`),
the store's answers and the request's mode it returns a :class:`Plan`, plain Python over ids and
records, so every decision can be tested without a model (as nano-vllm's block manager is).
Chunks are looked up by key (model fingerprint + token ids, verified on hit) through their stored
variants (:class:`~kvrag.engine.reuse.variants.StoredVariants`), the longest exact prefix in the
prefix cache. Turning a plan into tensors (the prompt's ids, the [N] masks, the cached KV placed
with RoPE re-rotation into the buffer) is :mod:`kvrag.engine.reuse.fusion`'s; an import contract
(``pyproject.toml``) keeps the model layer and the kernels out of this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrag.engine.reuse.prefix import PrefixCache
from kvrag.engine.reuse.segments import Segment, prompt_ids
from kvrag.engine.reuse.slices import marked
from kvrag.engine.reuse.variants import ExactDigest, StoredVariants, context_id, fix_overhead, prefix_overlap
from kvrag.engine.store.base import KVRecord, StoreKey, chunk_key

__all__ = ["ChunkUse", "Plan", "Planner"]


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
    overlap: float | None = None  # the used variant's context still before it (beta; 0: another context)
    found: bool = False  # the cache held its KV (reused, or computed anyway: see Plan.path)


@dataclass(slots=True)
class Plan:
    """A prefill plan for one request: where cached KV goes, and what is computed.

    Plain data over token ids and store records; :func:`kvrag.engine.reuse.fusion.prefill` turns it
    into tensors (the prompt's ids, the masks of :meth:`exact_spans` and :meth:`blended_spans`).
    ``ids`` are always the segments' ids, in order (set from them, never given).

    ``mode`` is what the request asked for (what its write-back keeps follows it); ``path`` is how
    the prefill runs: ``full`` (every token computed), ``prefix`` (only exact KV reused), ``blend``
    or ``reuse``. It starts as the mode (``full`` where the request reuses nothing: ``full=True``)
    and the cost model may lower it (:meth:`fall_back`); ``reason`` says why. What a ``blend``
    recomputes is the request's :class:`~kvrag.engine.reuse.budget.Budget`, not the plan's.
    """

    mode: str
    segments: list[Segment]
    full: bool = False  # every token is computed whatever is cached (the mode or the budget reuses nothing)
    ids: list[int] = field(init=False)  # the prompt's N token ids
    namespace: str = "default"  # the tenant whose cache entries the plan uses
    prefix_len: int = 0  # [0, prefix_len) reused exactly from the prefix cache
    prefix_records: list[tuple[int, KVRecord]] = field(default_factory=list)
    chunk_records: list[tuple[int, KVRecord]] = field(default_factory=list)  # (start, record) of blended hits
    exact_records: list[tuple[int, KVRecord]] = field(default_factory=list)  # (start, record) of exact variants
    chunks: list[ChunkUse] = field(default_factory=list)
    #: the prompt's tail (what follows its last chunk) held exactly with its last token's hidden state:
    #: (start, record), also in ``exact_records``; text between chunks not held (``gap_digests``) is computed
    tail: tuple[int, KVRecord] | None = None
    tail_digest: str | None = None  # what names the tail's KV: every token before it (None: no tail)
    #: text between chunks (a separator, a source's number) that exact KV may precede: segment index ->
    #: the digest of every token before it, which names its KV (``kind="gap"``, held like the tail)
    gap_digests: dict[int, str] = field(default_factory=dict)
    path: str = field(init=False)
    reason: str = ""

    def __post_init__(self) -> None:
        self.ids = prompt_ids(self.segments)
        self.path = "full" if self.full or self.mode == "full" else self.mode

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def is_full(self) -> bool:
        """Every token is computed, nothing reused: the request reuses nothing, or the plan fell back
        to a full prefill."""
        return self.path == "full"

    def fall_back(self, path: str, reason: str) -> None:
        """Run as ``path`` instead: ``prefix`` keeps only the exact KV (the exact prefix, exact chunk
        variants), ``full`` keeps nothing. Chunks whose KV is dropped are computed (``found`` stays)."""
        if path not in ("full", "prefix"):
            raise ValueError(f"a plan falls back to 'full' or 'prefix', not {path!r}")
        self.chunk_records = []
        if path == "full":
            self.prefix_len, self.prefix_records, self.exact_records, self.tail = 0, [], [], None
        for use in self.chunks:
            if use.hit and (path == "full" or use.source in ("store", "conversation")):
                use.hit, use.source, use.tier, use.fix = False, "computed", "", None
        self.path, self.reason = path, reason

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

    def exact_spans(self) -> list[tuple[int, int]]:
        """[start, end) of the positions whose KV is reused exactly (the exact prefix, exact chunk
        variants): never computed."""
        prefix = [(0, self.prefix_len)] if self.prefix_len else []
        return prefix + [(s, s + r.num_tokens) for s, r in self.exact_records]

    def blended_spans(self) -> list[tuple[int, int]]:
        """[start, end) of the blended chunk hits, in ``chunk_records``' order: the candidates a
        selection may recompute."""
        return [(s, s + r.num_tokens) for s, r in self.chunk_records]

    def exact_end(self) -> int:
        """Positions [0, exact_end) get exact KV (the first blended chunk starts the approximation)."""
        return min((s for s, _ in self.chunk_records), default=self.num_tokens)

    def context_overlap(self) -> float | None:
        """How much of the context the blended chunks' KV was computed in is before them in this
        prompt: Cache-Craft's beta, averaged over the blended tokens (1: their own context, 0: all
        computed behind other passages); None when nothing is blended."""
        blended = self._blended_uses()
        total = sum(u.length for u in blended)
        return sum(u.length * (u.overlap or 0.0) for u in blended) / total if total else None

    def _blended_uses(self) -> list[ChunkUse]:
        """The chunks whose stored KV this plan blends (hits from the store, not exact)."""
        return [u for u in self.chunks if u.hit and u.source == "store"]

    def dial_share(self, own: float, other: float, threshold: float) -> float:
        """The recompute share when each blended chunk adds its own: ``own`` of its tokens when its KV
        was computed in the context that precedes it here (beta >= ``threshold``), else ``other``
        (the quality dial of ``recompute_ratio="auto"``); ``own`` when nothing is blended."""
        blended = self._blended_uses()
        total = sum(u.length for u in blended)
        if not total:
            return own
        return sum(u.length * (own if (u.overlap or 0.0) >= threshold else other) for u in blended) / total

    def check_tail(self) -> None:
        """Drop the held tail unless what comes before it still gets exact KV (a conversation's turn
        put blended runs of its own KV in the plan since, or its prefix reaches into the tail): its
        positions are computed then. Held text between chunks past blended KV, or inside the
        prefix, is dropped alike."""
        if self.tail is not None and (self.chunk_records or self.tail not in self.exact_records):
            self.exact_records = [sr for sr in self.exact_records if sr is not self.tail]
            self.tail = None
        blended = min((s for s, _ in self.chunk_records), default=self.num_tokens)
        self.exact_records = [
            (s, r) for s, r in self.exact_records if r.kind != "gap" or self.prefix_len <= s < blended
        ]

    def first_chunk_start(self) -> int:
        return min((s.start for s in self.segments if s.kind == "chunk"), default=self.num_tokens)

    def tail_start(self) -> int:
        """Where the prompt's tail starts: the end of its last chunk (the number of tokens when the
        prompt has no chunk or ends with one: no tail)."""
        return max((s.end for s in self.segments if s.kind == "chunk"), default=self.num_tokens)


class Planner:
    """Decides, for a prompt's segments, what is reused from the cache and what is computed.

    Args:
        variants: the chunks' stored variants (store lookups, the variant index).
        prefix_cache: exact prompt prefixes in the store.
        fingerprint: the model's fingerprint (weights + tokenizer + dtype), part of every chunk key.
        namespace: the default tenant; a request may name another.
        context_label: how chunk KV was computed (part of every chunk key: records computed behind
            another kind of context never mix).
        kv_shape: (layers, KV heads, head dim) of the model: a prefix record of another shape ends
            the reused prefix (chunk records are judged by ``variants``).
        slice_tokens: > 0 (``EngineConfig.deterministic``): exact KV is reused only if computed in
            slices of this size (:func:`~kvrag.engine.reuse.slices.marked`); other exact KV (a blend's
            one pass computed it) is treated as not held, so what computes it again (a request's
            prefill in slices, the refresh) keeps it marked in its place.
    """

    def __init__(
        self,
        variants: StoredVariants,
        prefix_cache: PrefixCache,
        *,
        fingerprint: str,
        namespace: str,
        context_label: str,
        kv_shape: tuple[int, int, int],
        slice_tokens: int = 0,
    ) -> None:
        self.variants = variants
        self.prefix_cache = prefix_cache
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.context_label = context_label
        self.kv_shape = tuple(kv_shape)
        self.slice_tokens = slice_tokens

    def chunk_key(self, ids: list[int], namespace: str | None = None) -> StoreKey:
        """Key of a chunk's KV for a tenant (default: the engine's namespace)."""
        return chunk_key(namespace or self.namespace, self.fingerprint, ids, context=self.context_label)

    def plan(
        self,
        segments: list[Segment],
        *,
        mode: str,
        use_prefix: bool,
        full: bool = False,
        namespace: str | None = None,
        exact_only: bool = False,
        quiet: bool = False,
    ) -> Plan:
        """What to reuse and what to compute for a tenant's (``namespace``, default the engine's) prompt
        of ``segments`` (:class:`~kvrag.engine.reuse.segments.PromptTokenizer`).

        ``full`` mode, or ``full=True`` (a budget that recomputes everything), reuses nothing.
        Otherwise the exact prefix comes from the prefix cache (``use_prefix``); past it, ``blend``
        and ``reuse`` take each chunk's best stored variant (an exact one is placed as is,
        ``source="tree"``; another is blended, ``source="store"``). The prompt's last token is never
        reused: its logits start decoding, except where the prompt's **tail** (what follows its last
        chunk, the question) is held exactly, behind exactly the tokens before it, with the hidden
        state of its last token; text between chunks is held alike (``kind="gap"``, no hidden state)
        where nothing before it is blended: a prompt seen before whose KV before the tail is exact
        computes nothing more (the exact prefix stops at the tail, where its record starts).

        ``exact_only`` (with ``mode="prefix"``) also reuses exact chunk variants, and nothing blended:
        its prefill computes exactly what a full prefill does (the knowledge tree's refresh). Its
        lookups are looks, not uses (:meth:`~kvrag.engine.store.base.KVStore.peek`): no hit counted,
        no rank touched, a speculative entry still unused. ``quiet`` makes any plan's lookups looks
        (a speculative prefill: it is not a use until a request adopts it).
        """
        quiet = quiet or exact_only
        namespace = namespace or self.namespace
        plan = Plan(mode=mode, segments=segments, full=full, namespace=namespace)
        if plan.is_full:
            for i, s in enumerate(segments):
                if s.kind == "chunk":
                    key = self.chunk_key(s.ids, namespace)
                    plan.chunks.append(ChunkUse(i, s.start, len(s.ids), key, False, "computed"))
            return plan
        limit = plan.num_tokens - 1  # the last token is computed (its logits start decoding) unless the tail is held
        tail_start = plan.tail_start()
        if use_prefix:
            plan.prefix_len, plan.prefix_records = self.prefix_cache.lookup(
                plan.ids,
                plan.boundaries,
                min(limit, tail_start),
                namespace=namespace,
                quiet=quiet,
                slice_tokens=self.slice_tokens,
            )
            # a record of another shape (only a forged one) ends the prefix where it starts
            bad = next((i for i, (_, r) in enumerate(plan.prefix_records) if r.kv_shape != self.kv_shape), None)
            if bad is not None:
                plan.prefix_len = plan.prefix_records[bad][0]
                plan.prefix_records = plan.prefix_records[:bad]
        exact = ExactDigest(plan.ids)
        before: list[str] = []  # content ids of the chunks so far
        first_chunk = plan.first_chunk_start()
        held_to = plan.prefix_len  # [0, held_to) gets exact KV from the cache, so far
        for i, s in enumerate(segments):
            if s.kind != "chunk":
                if use_prefix and plan.prefix_len <= s.start and first_chunk < s.start and s.end <= tail_start:
                    plan.gap_digests[i] = exact.at(s.start)
                    if held_to == s.start and self._gap(plan, s, plan.gap_digests[i], quiet):
                        held_to = s.end
                continue
            key = self.chunk_key(s.ids, namespace)
            use = ChunkUse(i, s.start, len(s.ids), key, False, "computed", context=tuple(before))
            plan.chunks.append(use)
            before.append(context_id(s.ids))
            if s.end <= plan.prefix_len:
                use.hit, use.found, use.source = True, True, "prefix"
                continue
            if s.start < plan.prefix_len:
                continue
            use.digest = exact.at(s.start)
            if not (exact_only or mode in ("blend", "reuse")) or s.end > limit:  # the last token is always computed
                continue
            if exact_only:
                info, rec = self.variants.exact(key, s.ids, use.digest)
            else:
                info, rec = self.variants.best(key, s.ids, use.context, use.digest, quiet=quiet)
            exact_here = info is not None and info.exact is not None and info.exact == use.digest
            if rec is None or (exact_here and self.slice_tokens and not marked(rec.meta, self.slice_tokens)):
                continue  # not held (exact KV not computed in slices counts as not held: see slice_tokens)
            use.hit, use.found, use.tier = True, True, rec.tier
            use.fix = fix_overhead(info, use.context, use.digest)
            use.overlap = prefix_overlap(info, use.context)
            if exact_here:
                use.source = "tree"
                plan.exact_records.append((s.start, rec))
                if held_to == s.start:
                    held_to = s.end
            else:
                use.source = "store"
                plan.chunk_records.append((s.start, rec))
            if not quiet:  # a refresh or a speculation is not a use
                self.variants.used(info, use.fix)
        if use_prefix and tail_start < plan.num_tokens:
            plan.tail_digest = exact.at(tail_start)
            if held_to == tail_start:  # all before the tail is exact KV held (so nothing blended)
                rec = self._held_behind(plan, plan.tail_digest, plan.ids[tail_start:], "tail", quiet)
                if rec is not None:
                    plan.tail = (tail_start, rec)
                    plan.exact_records.append(plan.tail)
        return plan

    def _gap(self, plan: Plan, s: Segment, digest: str, quiet: bool) -> bool:
        """Text between chunks, named by every token before it (``digest``): its KV held exactly is
        reused when nothing before it is blended (a prompt asked again places it instead of computing
        it). Looked up only behind KV held exactly (the caller's check, so nothing before it is
        blended): behind a miss it would save a few tokens for a store round trip. Whether it is held."""
        rec = self._held_behind(plan, digest, list(s.ids), "gap", quiet)
        if rec is not None:
            plan.exact_records.append((s.start, rec))
        return rec is not None

    def _held_behind(self, plan: Plan, before: str, tokens: list[int], kind: str, quiet: bool) -> KVRecord | None:
        """The ``kind`` record (a tail, text between chunks) held for ``tokens`` behind ``before``, if
        its KV has the model's shape."""
        rec = self.prefix_cache.lookup_tail(
            before, tokens, namespace=plan.namespace, quiet=quiet, kind=kind, slice_tokens=self.slice_tokens
        )
        return rec if rec is not None and rec.kv_shape == self.kv_shape else None
