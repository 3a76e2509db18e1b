"""The planner's decisions, over token ids and a store of small records: no model, no tokenizer.

What a plan reuses decides what a prefill computes, so each rule is checked here on its own:
full prefill reuses nothing, a stored chunk is blended, an exact variant is placed as is, a
forged record (another model's KV shape) is never used, the last token is always computed, and a
damaged prefix chain ends where the damage starts.
"""

from __future__ import annotations

import pytest
import torch

from kvrag.engine.reuse.budget import Budget
from kvrag.engine.reuse.planner import Plan, Planner
from kvrag.engine.reuse.prefix import PrefixCache
from kvrag.engine.reuse.segments import Segment
from kvrag.engine.reuse.variants import ExactDigest, StoredVariants, VariantIndex, context_id
from kvrag.engine.store.base import KVRecord
from kvrag.engine.store.memory import MemoryStore

KV_SHAPE = (2, 1, 4)  # (layers, KV heads, head dim) of the pretend model
BLOCK = 4  # prefix-cache block size

LEAD = [1, 2, 3, 4, 5, 6]  # system prompt
DOC_A = list(range(100, 110))
DOC_B = list(range(200, 212))
QUESTION = [7, 8, 9]


class CountingStore(MemoryStore):
    """A memory store that remembers the reuses it is told of (Cache-Craft's frequency-reuse)."""

    def __init__(self) -> None:
        super().__init__(1 << 24)
        self.reuses: list[tuple] = []

    def record_reuse(self, key, cfo: float) -> None:
        self.reuses.append((key, cfo))
        super().record_reuse(key, cfo)


def record(ids: list[int], shape: tuple[int, int, int] = KV_SHAPE, fill: float = 0.0) -> KVRecord:
    layers, heads, dim = shape
    k = torch.full((layers, heads, len(ids), dim), fill)  # [L, Hkv, T, D]
    return KVRecord(torch.tensor(ids), k, k.clone())


def prompt(*parts: tuple[str, list[int]]) -> list[Segment]:
    """Positioned segments of (kind, ids) parts, as the prompt tokenizer makes them."""
    out, pos = [], 0
    for kind, ids in parts:
        out.append(Segment(kind, "", list(ids), pos))
        pos += len(ids)
    return out


def make_planner(store: MemoryStore | None = None, max_variants: int = 4) -> tuple[Planner, StoredVariants]:
    store = store if store is not None else CountingStore()
    variants = StoredVariants(store, VariantIndex(max_variants), KV_SHAPE)
    planner = Planner(
        variants,
        PrefixCache(store, "fingerprint", BLOCK),
        fingerprint="fingerprint",
        namespace="default",
        context_label="doc-v2",
        kv_shape=KV_SHAPE,
    )
    return planner, variants


def rag_prompt(*docs: list[int], lead: list[int] = LEAD) -> list[Segment]:
    return prompt(("text", lead), *(("chunk", d) for d in docs), ("text", QUESTION))


def test_a_plan_holds_the_segments_ids_and_spans_fusion_turns_into_masks():
    planner, variants = make_planner()
    variants.keep(planner.chunk_key(DOC_B), record(DOC_B), ())
    plan = planner.plan(rag_prompt(DOC_A, DOC_B), mode="blend", use_prefix=False)
    assert plan.ids == LEAD + DOC_A + DOC_B + QUESTION and plan.num_tokens == len(plan.ids)
    b = len(LEAD) + len(DOC_A)
    assert plan.blended_spans() == [(b, b + len(DOC_B))] and plan.exact_spans() == []
    assert plan.boundaries == [len(LEAD), b, b + len(DOC_B), plan.num_tokens]
    assert Plan(mode="full", segments=plan.segments).ids == plan.ids  # ids always follow the segments


@pytest.mark.parametrize(("mode", "ratio"), [("full", 0.15), ("blend", 1.0)])
def test_full_prefill_computes_everything_and_looks_nothing_up(mode, ratio):
    store = CountingStore()
    planner, variants = make_planner(store)
    for doc in (DOC_A, DOC_B):
        variants.keep(planner.chunk_key(doc), record(doc), ())
    before = store.stats()
    plan = planner.plan(
        rag_prompt(DOC_A, DOC_B), mode=mode, full=Budget("probe", ratio).reuses_nothing(mode), use_prefix=True
    )
    assert plan.is_full and plan.cached_spans() == [] and plan.prefix_len == 0
    assert [(u.hit, u.source) for u in plan.chunks] == [(False, "computed")] * 2
    assert [u.key for u in plan.chunks] == [planner.chunk_key(DOC_A), planner.chunk_key(DOC_B)]
    after = store.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"]) and store.reuses == []


def test_a_stored_chunk_becomes_a_blended_hit_and_the_store_hears_of_the_reuse():
    store = CountingStore()
    planner, variants = make_planner(store)
    kept = record(DOC_B, fill=1.0)
    assert variants.keep(planner.chunk_key(DOC_B), kept, ())  # computed behind nothing
    plan = planner.plan(rag_prompt(DOC_A, DOC_B), mode="blend", use_prefix=False)
    a, b = plan.chunks
    assert (a.hit, a.source) == (False, "computed")
    assert (b.hit, b.source, b.tier) == (True, "store", "memory")
    assert b.context == (context_id(DOC_A),) and b.digest == ExactDigest(plan.ids).at(b.start)
    assert b.fix == pytest.approx(0.5)  # its context (none) shares nothing with DOC_A: CCI 0.5 * (1 - 0)
    assert plan.chunk_records == [(b.start, kept)] and plan.exact_records == []
    assert store.reuses == [(planner.chunk_key(DOC_B), b.fix)]
    assert variants.index.variants(planner.chunk_key(DOC_B))[0].reuses == 1
    # reuse mode places it too; prefix mode never looks chunks up
    assert planner.plan(rag_prompt(DOC_A, DOC_B), mode="reuse", use_prefix=False).chunk_records
    prefix = planner.plan(rag_prompt(DOC_A, DOC_B), mode="prefix", use_prefix=True)
    assert prefix.cached_spans() == [] and not any(u.hit for u in prefix.chunks)


def test_the_variant_with_the_lowest_fix_overhead_is_used():
    planner, variants = make_planner()
    key = planner.chunk_key(DOC_B)
    alone, behind_a = record(DOC_B, fill=1.0), record(DOC_B, fill=2.0)
    assert variants.keep(key, alone, ())
    assert variants.keep(key, behind_a, (context_id(DOC_A),))
    plan = planner.plan(rag_prompt(DOC_A, DOC_B), mode="blend", use_prefix=False)
    assert plan.chunk_records[0][1] is behind_a and plan.chunks[1].fix == 0.0
    plan = planner.plan(rag_prompt(DOC_B), mode="blend", use_prefix=False)
    assert plan.chunk_records[0][1] is alone and plan.chunks[0].fix == 0.0


def test_an_exact_variant_is_placed_as_is_over_a_context_one():
    planner, variants = make_planner()
    key = planner.chunk_key(DOC_B)
    segments = rag_prompt(DOC_A, DOC_B)
    start = segments[2].start
    digest = ExactDigest(LEAD + DOC_A).at(start)
    in_context, exact = record(DOC_B, fill=1.0), record(DOC_B, fill=2.0)
    assert variants.keep(key, in_context, (context_id(DOC_A),))  # scores 0 here too, but is not exact
    assert variants.keep(key, exact, (context_id(DOC_A),), digest)
    plan = planner.plan(segments, mode="blend", use_prefix=False)
    use = plan.chunks[1]
    assert (use.hit, use.source, use.fix) == (True, "tree", 0.0)
    assert plan.exact_records == [(start, exact)] and plan.chunk_records == []
    assert plan.exact_spans() == [(start, start + len(DOC_B))] and plan.blended_spans() == []
    assert plan.exact_tokens == plan.cached_tokens == len(DOC_B)
    # another lead: the same chunks, but not the same tokens before them: blended
    other = planner.plan(rag_prompt(DOC_A, DOC_B, lead=[1, 2, 3]), mode="blend", use_prefix=False)
    assert other.chunks[1].source == "store" and len(other.chunk_records) == 1 and other.exact_records == []


def test_the_refresh_plans_exact_variants_only_and_as_looks():
    store = CountingStore()
    planner, variants = make_planner(store)
    key = planner.chunk_key(DOC_B)
    segments = rag_prompt(DOC_A, DOC_B)
    digest = ExactDigest(LEAD + DOC_A).at(segments[2].start)
    variants.keep(planner.chunk_key(DOC_A), record(DOC_A), ())  # a blendable variant: not for a refresh
    variants.keep(key, record(DOC_B), (context_id(DOC_A),), digest)
    before = store.stats()
    plan = planner.plan(segments, mode="prefix", use_prefix=True, exact_only=True)
    assert [u.source for u in plan.chunks] == ["computed", "tree"] and plan.chunk_records == []
    assert store.stats()["hits"] == before["hits"] and store.reuses == []  # looks, not uses
    assert variants.index.variants(key)[0].reuses == 0


def test_a_record_with_another_models_kv_shape_is_refused():
    store = CountingStore()
    planner, variants = make_planner(store)
    forged = record(DOC_B, shape=(3, 1, 4))  # right key, right tokens, KV of another shape
    assert store.put(planner.chunk_key(DOC_B), forged)
    plan = planner.plan(rag_prompt(DOC_A, DOC_B), mode="blend", use_prefix=False)
    assert plan.cached_spans() == [] and not plan.chunks[1].hit
    assert variants.index.variants(planner.chunk_key(DOC_B)) == []  # not indexed either
    assert not variants.fits(forged) and variants.fits(record(DOC_B))


def test_the_last_token_is_never_cached():
    planner, variants = make_planner()
    variants.keep(planner.chunk_key(DOC_B), record(DOC_B), ())
    ending = prompt(("text", LEAD), ("chunk", DOC_A), ("chunk", DOC_B))  # no question after the chunk
    plan = planner.plan(ending, mode="blend", use_prefix=True)
    assert plan.chunk_records == [] and not plan.chunks[1].hit
    # an exact prefix covering the whole prompt stops one token short of its end
    ids = plan.ids
    k = torch.zeros(KV_SHAPE[0], KV_SHAPE[1], len(ids), KV_SHAPE[2])  # [L, Hkv, N, D]
    planner.prefix_cache.insert(ids, k, k, 0, len(ids), plan.boundaries, namespace="default")
    again = planner.plan(ending, mode="prefix", use_prefix=True)
    assert 0 < again.prefix_len < len(ids) and again.prefix_len % BLOCK == 0
    assert all(s + r.num_tokens <= len(ids) - 1 for s, r in again.prefix_records)


def test_prefix_lookups_stop_at_a_bad_record():
    planner, _ = make_planner()
    segments = prompt(("text", list(range(1, 14))), ("text", QUESTION))  # 13 + 3 tokens
    ids, bounds = [t for s in segments for t in s.ids], [s.end for s in segments]

    def kv(start: int, end: int, shape=KV_SHAPE) -> torch.Tensor:
        return torch.zeros(shape[0], shape[1], end - start, shape[2])  # [L, Hkv, T, D]

    cache = planner.prefix_cache
    assert cache.insert(ids, kv(0, 4), kv(0, 4), 0, 4, bounds, namespace="default") == 1
    first = planner.plan(segments, mode="prefix", use_prefix=True)
    assert first.prefix_len == 4 and len(first.prefix_records) == 1
    # the chain's second block forged with another shape, a good third block behind it
    assert cache.insert(ids, kv(4, 8, (3, 1, 4)), kv(4, 8, (3, 1, 4)), 4, 8, bounds, namespace="default") == 1
    assert cache.insert(ids, kv(8, 12), kv(8, 12), 8, 12, bounds, namespace="default") == 1
    assert cache.lookup(ids, bounds, len(ids) - 1, namespace="default")[0] == 12  # the cache itself finds all three
    plan = planner.plan(segments, mode="prefix", use_prefix=True)
    assert plan.prefix_len == 4 and [s for s, _ in plan.prefix_records] == [0]


def test_chunks_inside_the_exact_prefix_are_prefix_hits_and_one_across_it_is_computed():
    planner, variants = make_planner()
    variants.keep(planner.chunk_key(DOC_A), record(DOC_A), ())
    segments = rag_prompt(DOC_A, DOC_B)
    ids, bounds = [t for s in segments for t in s.ids], [s.end for s in segments]
    end = segments[1].end + 4  # 6 + 10 + 4 = 20: five blocks, into DOC_B
    k = torch.zeros(KV_SHAPE[0], KV_SHAPE[1], end, KV_SHAPE[2])  # [L, Hkv, T, D]
    planner.prefix_cache.insert(ids, k, k, 0, end, bounds, namespace="default")
    plan = planner.plan(segments, mode="blend", use_prefix=True)
    assert plan.prefix_len == end
    assert [(u.hit, u.source) for u in plan.chunks] == [(True, "prefix"), (False, "computed")]
    assert plan.chunk_records == [] and plan.exact_spans() == [(0, end)]


def test_tenants_never_share_chunk_keys():
    planner, variants = make_planner()
    variants.keep(planner.chunk_key(DOC_B, "alice"), record(DOC_B), ())
    mine = planner.plan(rag_prompt(DOC_B), mode="blend", use_prefix=False, namespace="alice")
    theirs = planner.plan(rag_prompt(DOC_B), mode="blend", use_prefix=False, namespace="bob")
    assert mine.chunks[0].hit and not theirs.chunks[0].hit
    assert (
        theirs.namespace == "bob"
        and planner.plan(rag_prompt(DOC_B), mode="full", use_prefix=False).namespace == "default"
    )


def test_stored_variants_keep_want_and_room():
    store = CountingStore()
    variants = StoredVariants(store, VariantIndex(max_variants=2), KV_SHAPE)
    key = make_planner(store)[0].chunk_key(DOC_B)
    assert not variants.holds(key) and variants.room(key)
    assert variants.keep(key, record(DOC_B), ("x",))  # the first variant: under the chunk's own key
    assert store.contains(key) and variants.holds(key) and variants.index.keys(key) == [key]
    assert variants.wants(key, ("y",), wanted=2) and not variants.wants(key, ("y",), wanted=1)
    assert variants.keep(key, record(DOC_B), ("y",))  # a later one: under a key named by its context
    (second,) = [k for k in variants.index.keys(key) if k != key]
    assert store.contains(second) and not variants.wants(key, ("y",), wanted=3)
    assert not variants.keep(key, record(DOC_B), ("y",))  # the same context is kept once
    # at the cap: one kept ahead of need never pushes a variant out; one a request computed does
    assert not variants.room(key) and not variants.keep(key, record(DOC_B), ("z",), speculative=True)
    variants.used(variants.index.variants(key)[0], 0.5)
    assert variants.keep(key, record(DOC_B), ("z",))
    assert not store.contains(second) and len(variants.index.keys(key)) == 2  # the least reused left the store
    # a restarted process (an empty index over the same store) finds its variants from their headers
    again = StoredVariants(store, VariantIndex(max_variants=2), KV_SHAPE)
    assert not again.wants(key, ("z",), wanted=2)
    assert set(again.index.keys(key)) == set(variants.index.keys(key))
    # a variant the store lost is forgotten, which makes room again; the chunk is still held
    third = [k for k in variants.index.keys(key) if k != key][0]
    store.remove(third)
    assert variants.room(key) and variants.index.keys(key) == [key] and variants.holds(key)
