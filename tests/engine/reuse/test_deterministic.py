"""Exact means identical: a prompt answered from exactly stored KV gets the full prefill's tokens and
logits bit for bit (prefills in fixed slices: :mod:`kvrag.engine.reuse.slices`)."""

from __future__ import annotations

import pytest
import torch

from kvrag import Engine, SamplingParams
from kvrag.engine.reuse.prefix import PrefixCache
from kvrag.engine.reuse.slices import META_KEY, canonical_end, mark, plan_slices
from kvrag.engine.reuse.variants import StoredVariants, VariantIndex
from kvrag.engine.store.base import KVRecord, StoreKey
from kvrag.engine.store.memory import MemoryStore
from tests.helpers import PREFIX, SUFFIX, as_dtype, last_logits, make_docs

SLICE = 32  # small, so that the tiny prompts (~200 tokens) span several slices


def make(model, tok, **kw) -> Engine:
    kw.setdefault("deterministic_slice_tokens", SLICE)
    kw.setdefault("deterministic", True)
    return Engine.from_model(model, tok, sampling=SamplingParams(max_new_tokens=12), **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_reuse_gives_the_full_prefills_tokens_and_logits_bit_for_bit(tiny_model, tiny_tokenizer, dtype):
    with make(as_dtype(tiny_model, dtype), tiny_tokenizer) as engine:
        docs = make_docs(3, seed=71)
        engine.generate(docs, PREFIX, "another question? " + SUFFIX)  # stores the documents exactly
        engine.flush()
        exact = last_logits(engine, docs, "blend")  # the exact path: prefix blocks and exact variants
        assert torch.equal(exact, last_logits(engine, docs, "full"))
        again = engine.generate(docs, PREFIX, SUFFIX)
        s = again.stats
        assert [c.source for c in s.chunks] == ["tree"] * 3 and s.recomputed_tokens == 0
        assert 0 < s.computed_tokens < s.prompt_tokens - SLICE  # whole slices reused
        assert s.exact_tokens + s.computed_tokens == s.prompt_tokens  # the stats say what ran: whole slices
        assert s.cached_tokens == s.exact_tokens  # nothing blended
        assert again.token_ids == engine.generate(docs, PREFIX, SUFFIX, mode="full").token_ids


def _rec(n: int, meta: dict) -> KVRecord:
    return KVRecord(torch.arange(n), torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), meta=meta)


def test_a_slice_is_reused_only_where_kv_computed_in_full_slices_of_its_size_covers_it():
    # a prefix block of 40 tokens computed by a 70-token prompt in slices of 32: [0, 64) is canonical
    block = _rec(40, mark({"parent": "p"}, 32, 64))
    assert canonical_end(block, 0, 32) == 40 and canonical_end(block, 30, 32) == 64
    assert canonical_end(block, 0, 16) == 0  # another slice size: nothing
    assert canonical_end(_rec(40, {"parent": "p"}), 0, 32) == 0  # unmarked (one pass, or a blend's)
    assert block.meta[META_KEY] == [32, 64]
    # slice [32, 64) has a hole at 40: computed whole, as is the prompt's last, partial slice
    assert plan_slices(80, 32, [(0, 40), (41, 70)]) == [(0, 32, True), (32, 64, False), (64, 80, False)]
    assert plan_slices(64, 32, [(0, 64)]) == [(0, 32, True), (32, 64, True)]
    # past the last full slice of the 90-token prompt that computed it: what a 90-token prompt computes
    last = _rec(40, mark({}, 32, 64, 90))
    assert canonical_end(last, 50, 32, 90) == 90 and canonical_end(last, 50, 32, 100) == 64


def test_kv_computed_in_slices_replaces_exact_kv_kept_without_their_mark():
    """A prefix block, an exact chunk variant, text between chunks kept from a one-pass prefill are not
    held for a deterministic plan; KV computed in slices takes their place (same key), KV without the
    mark does not."""
    store = MemoryStore(10**8)
    cache = PrefixCache(store, "fp", block=4)
    ids, k = list(range(8)), torch.zeros(1, 1, 8, 2)
    assert cache.insert(ids, k, k, 0, 8, [8], namespace="t") == 2  # one pass: unmarked
    assert cache.lookup(ids, [8], 8, namespace="t")[0] == 8
    assert cache.lookup(ids, [8], 8, namespace="t", slice_tokens=32)[0] == 0
    assert cache.insert(ids, k, k, 0, 8, [8], namespace="t") == 0  # unmarked again: kept as it was
    assert cache.insert(ids, k, k, 0, 8, [8], namespace="t", slices=(32, 0, 8)) == 2  # replaced
    assert cache.lookup(ids, [8], 8, namespace="t", slice_tokens=32)[0] == 8
    assert cache.insert(ids, k, k, 0, 8, [8], namespace="t", slices=(32, 0, 8)) == 0

    variants = StoredVariants(store, VariantIndex(max_variants=2), (1, 1, 2))
    key = StoreKey("t", "chunk")
    assert variants.keep(key, _rec(8, {}), ("a",), "digest")  # exact, one pass
    assert variants.keep(key, _rec(8, {}), ("b",))  # another context: the chunk at its cap
    assert variants.holds_exact(key, "digest")
    assert variants.keep(key, _rec(8, mark({}, 32, 0, 8)), ("a",), "digest", speculative=True)  # needs no room
    info, rec = variants.exact(key, list(range(8)), "digest")
    assert rec.meta[META_KEY] == [32, 0, 8] and len(variants.index.keys(key)) == 2
    assert not variants.keep(key, _rec(8, mark({}, 32, 0, 8)), ("a",), "digest")  # held so already
    # text between chunks alike
    assert cache.insert_gap("d", [1], k[:, :, :1], k[:, :, :1], namespace="t") == 1
    assert cache.lookup_tail("d", [1], namespace="t", kind="gap", slice_tokens=32) is None
    assert cache.insert_gap("d", [1], k[:, :, :1], k[:, :, :1], namespace="t", slices=(32, 0, 8)) == 1
    assert cache.lookup_tail("d", [1], namespace="t", kind="gap", slice_tokens=32) is not None


def test_an_exact_prefix_is_reused_up_to_the_last_slice_boundary_below_its_end(tiny_model, tiny_tokenizer):
    """A shorter prompt's whole exact prefix stored (prefix mode): a longer prompt with the same lead
    reuses its whole slices, computes the rest in the same slices, and matches the full prefill."""
    with make(as_dtype(tiny_model, "bfloat16"), tiny_tokenizer) as engine:
        docs = make_docs(3, seed=73)
        engine.generate(docs[:1], PREFIX, SUFFIX, mode="prefix")  # its whole exact prompt kept as prefix blocks
        engine.flush()
        g = engine.generate(docs, PREFIX, SUFFIX, mode="prefix")
        assert g.stats.prefix_tokens >= 2 * SLICE
        assert g.stats.computed_tokens == g.stats.prompt_tokens - (g.stats.prefix_tokens // SLICE) * SLICE
        assert torch.equal(last_logits(engine, docs, "prefix"), last_logits(engine, docs, "full"))
        assert g.token_ids == engine.generate(docs, PREFIX, SUFFIX, mode="full").token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_text_between_chunks_is_reused_in_whole_slices_too(tiny_model, tiny_tokenizer, dtype):
    """Text between the documents is kept exactly with the slices' mark: the same prompt again reuses
    every slice (nothing computed) and answers as the full prefill does."""
    with make(as_dtype(tiny_model, dtype), tiny_tokenizer) as engine:
        docs = make_docs(3, seed=73)
        engine.register(docs)
        prompt = PREFIX + "\n--\n".join(docs) + "\n" + SUFFIX
        first = engine.generate(prompt=prompt)
        engine.flush()
        again = engine.generate(prompt=prompt)
        assert again.stats.computed_tokens == 0 and again.stats.exact_tokens == again.stats.prompt_tokens
        assert again.token_ids == first.token_ids == engine.generate(prompt=prompt, mode="full").token_ids


def rag_prompt(docs, suffix=SUFFIX) -> str:
    """A prompt as a LangChain "stuff" chain renders it: the documents with a separator between them."""
    return PREFIX + "\n\n".join(docs) + "\n" + suffix


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_blended_prompt_asked_again_after_its_refresh_reuses_its_slices(tiny_model, tiny_tokenizer, dtype):
    """Issue 60's "again" bug: a document a blend's one pass computed (missed, everything before it
    exact) was kept exact without the slice mark, the refresh skipped it, and the separators between
    documents were computed again, so the same prompt again recomputed its slices while its plan said
    exact. The refresh now computes such KV in slices, and the text between chunks is kept too."""
    with make(as_dtype(tiny_model, dtype), tiny_tokenizer, promotion_threshold=1) as engine:
        docs = make_docs(4, seed=75)
        engine.register(docs)
        engine.generate(prompt=rag_prompt(docs[:2]))  # docs 0 and 1 computed exactly behind each other
        engine.flush()
        prompt = rag_prompt([docs[2], docs[1], docs[0]])  # doc 2 computed in the blend's one pass; 1, 0 blended
        first = engine.generate(prompt=prompt)
        assert [c.source for c in first.stats.chunks] == ["computed", "store", "store"]
        engine.flush()  # the idle-time refresh computes the prompt exactly, in slices
        again = engine.generate(prompt=prompt)
        s = again.stats
        assert [c.source for c in s.chunks] == ["tree"] * 3 and s.recomputed_tokens == 0
        assert s.computed_tokens == 0 and s.exact_tokens == s.prompt_tokens  # every slice reused: the tail held
        assert again.token_ids == engine.generate(prompt=prompt, mode="full").token_ids
        other = rag_prompt([docs[2], docs[1], docs[0]], "tell me, " + SUFFIX)  # another question
        g = engine.generate(prompt=other)
        assert 0 < g.stats.computed_tokens <= engine.count_tokens("\ntell me, " + SUFFIX) + SLICE  # its last slices
        assert g.stats.exact_tokens + g.stats.computed_tokens == g.stats.prompt_tokens
        assert g.token_ids == engine.generate(prompt=other, mode="full").token_ids


def test_the_refresh_keeps_again_in_slices_the_lead_a_blend_kept(tiny_model, tiny_tokenizer):
    """A cold blend (every document warmed in other company) keeps the lead's prefix blocks from its
    one pass, unmarked: the planner takes them for not held, and the refresh keeps them in slices."""
    with make(as_dtype(tiny_model, "bfloat16"), tiny_tokenizer, promotion_threshold=1) as engine:
        docs = make_docs(3, seed=77)
        engine.warm(docs[::-1])
        first = engine.generate(docs, PREFIX, SUFFIX)
        assert [c.source for c in first.stats.chunks] == ["store"] * 3 and first.stats.prefix_tokens == 0
        engine.flush()
        again = engine.generate(docs, PREFIX, SUFFIX)
        assert again.stats.computed_tokens == 0 and again.stats.prefix_tokens > 0
        assert again.token_ids == engine.generate(docs, PREFIX, SUFFIX, mode="full").token_ids


def test_the_same_prompt_again_reuses_its_last_partial_slice(tiny_model, tiny_tokenizer):
    """A chunk reaching into the prompt's last, partial slice: its KV there is what a prompt as long
    computes, so the same prompt again computes nothing (another prompt's slice there has another shape)."""
    with make(as_dtype(tiny_model, "bfloat16"), tiny_tokenizer) as engine:
        docs = make_docs(3, seed=79)
        first = engine.generate(docs, PREFIX, "?")
        n, tail = first.stats.prompt_tokens, engine.count_tokens("?")
        assert n % SLICE > tail  # the last chunk ends past the last full slice
        engine.flush()
        again = engine.generate(docs, PREFIX, "?")
        assert again.stats.computed_tokens == 0 and again.token_ids == first.token_ids
        assert torch.equal(
            last_logits(engine, docs, "blend", suffix="?"), last_logits(engine, docs, "full", suffix="?")
        )
        longer = engine.generate(docs, PREFIX, "? " * SLICE)  # the same chunks, the slice there of another shape
        assert longer.stats.computed_tokens >= n % SLICE
        assert longer.token_ids == engine.generate(docs, PREFIX, "? " * SLICE, mode="full").token_ids
