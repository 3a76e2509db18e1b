"""Chunk-KV variants: Cache-Craft's fix overhead, the variant index, exact chunk sequences (knowledge tree)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrag import InvalidRequestError, SamplingParams
from kvrag.engine.reuse.variants import (
    ExactDigest,
    VariantIndex,
    VariantInfo,
    context_id,
    fix_overhead,
    order_penalty,
    prefix_overlap,
)
from kvrag.engine.store.base import StoreKey
from tests.helpers import PREFIX, SUFFIX, last_logits, make_docs


def key(name: str) -> StoreKey:
    return StoreKey("default", name * 8)


def test_prefix_overlap_weighs_the_context_the_prompt_still_has():
    info = VariantInfo(key("a"), ("x", "y", "z"))
    assert prefix_overlap(info, ["x", "y", "z"]) == 1.0
    assert prefix_overlap(info, ["q", "y"]) == pytest.approx(1 / 3)
    assert prefix_overlap(info, []) == 0.0
    weighted = VariantInfo(key("a"), ("x", "y"), weights=(0.9, 0.1))  # Cache-Craft's inter-attention
    assert prefix_overlap(weighted, ["x"]) == pytest.approx(0.9)
    alone = VariantInfo(key("a"), ())  # computed behind nothing: fits a prompt with nothing before it
    assert (prefix_overlap(alone, []), prefix_overlap(alone, ["x"])) == (1.0, 0.0)


def test_order_penalty_is_the_normalised_kendall_tau_distance():
    assert order_penalty(["a", "b", "c"], ["a", "b", "c"]) == 0.0
    assert order_penalty(["a", "b", "c"], ["c", "b", "a"]) == 1.0
    assert order_penalty(["a", "b", "c"], ["b", "a", "c", "d"]) == pytest.approx(1 / 3)
    assert order_penalty(["a", "b"], ["b", "x"]) == 0.0  # fewer than two in common


def test_fix_overhead_is_zero_for_an_exact_variant_and_grows_with_mismatch():
    info = VariantInfo(key("a"), ("x", "y", "z"), exact="d1", cci=0.8)
    assert fix_overhead(info, ["x", "y", "z"], "d1") == 0.0
    same = fix_overhead(info, ["x", "y", "z"], "other")
    swapped = fix_overhead(info, ["y", "x", "z"], "other")
    foreign = fix_overhead(info, ["q"], "other")
    assert same == 0.0 < swapped < foreign == pytest.approx(0.8)


def test_exact_digest_names_everything_before_a_position():
    a, b = ExactDigest([1, 2, 3, 4]), ExactDigest([1, 2, 9, 4])
    assert a.at(2) == b.at(2) and a.at(3) != b.at(3)
    with pytest.raises(ValueError):
        a.at(1)


def test_variant_index_keeps_the_most_reused_within_its_cap():
    index = VariantIndex(max_variants=2)
    base = key("b")
    first, second, third = VariantInfo(key("1"), ("x",)), VariantInfo(key("2"), ("y",)), VariantInfo(key("3"), ())
    assert index.add(base, first) == [] and index.add(base, second) == []
    index.used(first)
    assert index.add(base, third) == [second.key]  # the least reused goes, never the one just added
    assert [v.key for v in index.variants(base)] == [first.key, third.key]
    index.drop(base, first.key)
    index.drop(base, third.key)
    assert index.variants(base) == [] and len(index) == 0
    assert VariantInfo.from_record(base, _record_with({"context": ["x"], "exact": "d", "cci": 2.0})).cci is None


def _record_with(meta):
    from kvrag.engine.store.base import KVRecord

    return KVRecord(torch.tensor([1]), torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), meta=meta)


def test_a_cold_request_leaves_an_exact_sequence_the_next_one_reuses_exactly(tiny_engine):
    """RAGCache's knowledge tree: chunks a request computed behind an exact prefix are kept with the
    digest of everything before them; a prompt with the same lead and the same chunks in the same
    order reuses them exactly (nothing recomputed, the full prefill's logits), whatever follows."""
    docs = make_docs(3, seed=31)
    cold = tiny_engine.generate(docs, PREFIX, SUFFIX, max_new_tokens=1)
    assert cold.stats.chunk_misses == 3
    tiny_engine.flush()
    again = tiny_engine.generate(docs, PREFIX, "another question?" + SUFFIX, max_new_tokens=1)
    assert [c.source for c in again.stats.chunks] == ["tree"] * 3
    assert again.stats.recomputed_tokens == 0 and again.stats.exact_tokens == again.stats.cached_tokens
    assert all(c.fix == 0.0 for c in again.stats.chunks)
    exact = last_logits(tiny_engine, docs, "blend", 0.15)
    torch.testing.assert_close(exact, last_logits(tiny_engine, docs, "full"), rtol=1e-4, atol=1e-4)
    # another order: the first chunk is still on the tree's path; the others are blended
    moved = tiny_engine.generate([docs[0], docs[2], docs[1]], PREFIX, SUFFIX, max_new_tokens=1)
    assert [c.source for c in moved.stats.chunks] == ["tree", "store", "store"]
    assert 0 < moved.stats.chunks[1].fix


def test_warmed_chunks_remember_their_context(tiny_engine):
    docs = make_docs(3, seed=32)
    tiny_engine.warm(docs)
    ids = [tiny_engine.prompt_tokenizer.tokenize(d) for d in docs]
    infos = tiny_engine.variants.index.variants(tiny_engine.planner.chunk_key(ids[2]))
    assert len(infos) == 1 and infos[0].context[-2:] == (context_id(ids[0]), context_id(ids[1]))
    g = tiny_engine.generate(docs, PREFIX, SUFFIX, max_new_tokens=1)  # the warm order: the context fits
    h = tiny_engine.generate(docs[::-1], PREFIX, SUFFIX, max_new_tokens=1)
    assert g.stats.chunks[2].fix < h.stats.chunks[0].fix
    # Cache-Craft's beta in the stats: first in the prompt, nothing of its warm company precedes it
    assert h.stats.chunks[0].overlap == 0.0 < g.stats.chunks[2].overlap <= 1.0


def test_similarity_order_puts_each_passage_next_to_the_ones_most_like_it():
    from kvrag.engine.reuse.chunks import similarity_order

    a, b = list(range(100, 140)), list(range(300, 340))
    docs = [a, b, a[:35] + [1, 2, 3, 4, 5], b[:36] + [9, 8, 7, 6]]
    order = similarity_order(docs)
    assert order[0] == 0 and set(order) == {0, 1, 2, 3}
    assert abs(order.index(0) - order.index(2)) == 1 and abs(order.index(1) - order.index(3)) == 1
    vectors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.1, 0.9]])
    assert similarity_order(docs, vectors) == [0, 2, 3, 1]
    assert similarity_order(docs, [np.asarray(v) for v in vectors.tolist()]) == [0, 2, 3, 1]  # rows of arrays
    with pytest.raises(InvalidRequestError, match="one length"):
        similarity_order(docs, [[1.0, 0.0], [0.0, 1.0], [0.9], [0.1, 0.9]])


def test_warm_in_similar_order_computes_each_chunk_behind_its_neighbours(tiny_engine):
    docs = make_docs(4, seed=33)
    reports = []
    w = tiny_engine.warm(
        docs,
        order="similar",
        embeddings=[[1, 0], [0, 1], [1, 0.1], [0.1, 1]],
        progress=lambda d, t: reports.append((d, t)),
    )
    assert w.computed == 4 and reports[-1][0] == reports[-1][1]
    ids = [tiny_engine.prompt_tokenizer.tokenize(d) for d in docs]
    third = tiny_engine.variants.index.variants(tiny_engine.planner.chunk_key(ids[2]))[0]
    assert third.context[-1] == context_id(ids[0])  # 2 was computed right behind 0, its most similar
    with pytest.raises(InvalidRequestError, match="order"):
        tiny_engine.warm(docs, order="random")


def test_a_chunk_recomputed_whole_becomes_a_variant_for_this_company(tiny_model, tiny_tokenizer):
    """Cache-Craft's variants: a cached chunk that a request recomputes whole (focus) is kept as a
    new variant computed behind this prompt's chunks; the same company next time uses it. (Without
    the knowledge tree's refresh, which would make the whole sequence exact: tests/engine/serving/test_refresh.py.)"""
    import benchmarks.selections  # noqa: F401  (registers focus, a strategy that recomputes chunks whole)
    from kvrag import Engine

    with Engine.from_model(
        tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=8), tree_refresh=False
    ) as engine:
        _recomputed_chunks_become_variants(engine)


def _recomputed_chunks_become_variants(tiny_engine) -> None:
    docs = make_docs(4, words=60, seed=34)
    tiny_engine.warm(docs)
    order = docs[::-1]
    g = tiny_engine.generate(order, PREFIX, SUFFIX, selection="focus", recompute_ratio=0.5, max_new_tokens=1)
    tiny_engine.flush()
    ids = [tiny_engine.prompt_tokenizer.tokenize(d) for d in order]
    counts = [len(tiny_engine.variants.index.variants(tiny_engine.planner.chunk_key(x))) for x in ids]
    assert max(counts) == 2  # the warm() variant and this prompt's
    again = tiny_engine.generate(order, PREFIX, SUFFIX, selection="focus", recompute_ratio=0.5, max_new_tokens=1)
    fixes = [c.fix for c in again.stats.chunks]
    for n, chunk in zip(counts, again.stats.chunks):
        if n == 2:
            assert chunk.fix == 0.0  # computed in exactly this company
    assert g.stats.chunk_hits == again.stats.chunk_hits == 4 and min(fixes) == 0.0


def test_lookup_finds_a_chunk_held_only_as_a_later_variant(tiny_engine, docs):
    # the chunk's first variant (under its own key) evicted, a variant from another context left
    tiny_engine.generate(docs[:2], PREFIX, SUFFIX)  # docs[1] behind docs[0]
    tiny_engine.flush()
    tiny_engine.generate([docs[2], docs[1]], PREFIX, SUFFIX, recompute_ratio=1.0)  # docs[1] again, other company
    tiny_engine.flush()
    key = tiny_engine.planner.chunk_key(tiny_engine.prompt_tokenizer.tokenize(docs[1]))
    others = [k for k in tiny_engine.variants.index.keys(key) if k != key]
    assert others, "the recomputed chunk was not kept as a second variant"
    tiny_engine.store.remove(key)
    assert tiny_engine.lookup([docs[1]], PREFIX, SUFFIX).chunks_stored == 1


def test_auto_spends_on_the_tokens_nearest_the_question_when_the_chunks_come_from_other_company(
    tiny_model, tiny_tokenizer
):
    """Issue 35: with the default selection and ratio "auto", a prompt whose chunk KV was all computed
    behind other passages runs ``other_context_selection`` at ``other_context_ratio``; own company keeps the
    probe, and a request that names a selection or a ratio gets what it names."""
    from kvrag import Engine

    docs = make_docs(6, words=60, seed=35)
    kw = dict(sampling=SamplingParams(max_new_tokens=2), tree_refresh=False, cost_model=False)

    def other_company(engine) -> None:  # each of docs[0..2] written back behind another passage only
        for a, b in ((docs[0], docs[3]), (docs[1], docs[4]), (docs[2], docs[5])):
            engine.generate([b, a], PREFIX, SUFFIX)
        engine.flush()

    with Engine.from_model(tiny_model, tiny_tokenizer, **kw) as engine:
        other_company(engine)
        g = engine.generate(docs[:3], PREFIX, SUFFIX)
        assert g.stats.chunk_hits == 3 and g.stats.path == "blend"
        assert (g.stats.selection, g.stats.recompute_ratio, g.stats.auto) == ("recency", 0.13, False)
        assert engine.generate(docs[:3], PREFIX, SUFFIX, selection="probe").stats.selection == "probe"
        assert engine.generate(docs[:3], PREFIX, SUFFIX, recompute_ratio=0.2).stats.selection == "probe"
        assert "recency, 13% of each such chunk" in engine.info().blend  # what a deployment prints at start-up
    with Engine.from_model(tiny_model, tiny_tokenizer, other_context_selection=None, **kw) as engine:
        other_company(engine)
        assert engine.generate(docs[:3], PREFIX, SUFFIX).stats.selection == "probe"
        assert "another context" not in engine.info().blend
    with Engine.from_model(tiny_model, tiny_tokenizer, other_context_overlap=0.0, **kw) as engine:
        other_company(engine)  # no overlap is below 0: never foreign
        assert engine.generate(docs[:3], PREFIX, SUFFIX).stats.selection == "probe"
    with Engine.from_model(tiny_model, tiny_tokenizer, **kw) as engine:
        engine.generate(docs[:3], PREFIX, SUFFIX)  # own company, then another order: each blended
        engine.flush()  # chunk has company of its own before it
        g = engine.generate([docs[0], docs[2], docs[1]], PREFIX, SUFFIX)
        assert g.stats.chunk_hits == 3 and g.stats.path == "blend" and g.stats.selection == "probe"
    with pytest.raises(InvalidRequestError, match="unknown selection 'nearest'"):
        Engine.from_model(tiny_model, tiny_tokenizer, other_context_selection="nearest")
    with pytest.raises(InvalidRequestError, match="other_context_selection"):
        Engine.from_model(tiny_model, tiny_tokenizer, other_context_selection="")
    with pytest.raises(InvalidRequestError, match="other_context_overlap"):
        Engine.from_model(tiny_model, tiny_tokenizer, other_context_overlap=1.5)


def test_the_quality_dial_sets_each_chunks_share_by_the_company_its_kv_was_computed_in(tiny_model, tiny_tokenizer):
    """Issue 35's dial: with ratio "auto", each blended chunk of a foreign prompt adds its quality's
    share of the budget: the own-company share when its KV's company precedes it here, else the
    foreign share; uncalibrated own-company prompts recompute the own share."""
    from kvrag import Engine
    from kvrag.config import QUALITIES, QUALITY_SHARES

    docs = make_docs(8, words=60, seed=36)
    kw = dict(sampling=SamplingParams(max_new_tokens=2), tree_refresh=False, cost_model=False)
    with Engine.from_model(tiny_model, tiny_tokenizer, **kw) as engine:
        for a, b in ((docs[0], docs[4]), (docs[1], docs[5]), (docs[2], docs[6]), (docs[3], docs[7])):
            engine.generate([b, a], PREFIX, SUFFIX)  # docs 4-7 first (behind nothing), 0-3 behind them
        engine.flush()
        # docs[5] leads as it was computed: exact, spends nothing; docs[0] follows its company
        # (docs[4]): own; docs[4], [2], [3], [7] follow other passages: foreign
        prompt = [docs[5], docs[4], docs[0], docs[2], docs[3], docs[7]]
        for quality in QUALITIES:
            g = engine.generate(prompt, PREFIX, SUFFIX, quality=quality)
            assert [c.source for c in g.stats.chunks] == ["tree"] + ["store"] * 5 and g.stats.selection == "recency"
            own, foreign = engine.config.quality_shares(quality)
            sizes = [c.tokens for c in g.stats.chunks][1:]
            want = (sizes[1] * own + (sum(sizes) - sizes[1]) * foreign) / sum(sizes)
            assert g.stats.recompute_ratio == pytest.approx(want)
        assert QUALITY_SHARES["fast"] == engine.config.quality_shares("fast")
        assert engine.config.quality_shares("balanced") == (0.15, 0.13)  # auto_ratio, other_context_ratio
        own_company = engine.generate([docs[4], docs[0]], PREFIX, SUFFIX, quality="fast")
        assert (own_company.stats.selection, own_company.stats.recompute_ratio) == ("probe", 0.10)
        with pytest.raises(InvalidRequestError, match="quality must be one of 'fast', 'balanced', 'faithful'"):
            engine.generate(prompt, PREFIX, SUFFIX, quality="best")
    with Engine.from_model(tiny_model, tiny_tokenizer, quality="faithful", **kw) as engine:
        assert "auto (faithful): 30%" in engine.info().blend
    with pytest.raises(InvalidRequestError, match="quality must be one of"):
        Engine.from_model(tiny_model, tiny_tokenizer, quality="max")


def test_plan_context_overlap_averages_beta_over_the_blended_tokens():
    from kvrag.engine.reuse.planner import ChunkUse, Plan

    plan = Plan(mode="blend", segments=[])
    assert plan.context_overlap() is None  # nothing blended
    plan.chunks = [
        ChunkUse(0, 0, 30, key("a"), True, "store", overlap=0.0),
        ChunkUse(1, 30, 10, key("b"), True, "store", overlap=0.5),
        ChunkUse(2, 40, 50, key("c"), True, "tree", overlap=1.0),  # exact: not blended
        ChunkUse(3, 90, 20, key("d"), False, "computed"),
    ]
    assert plan.context_overlap() == pytest.approx((30 * 0.0 + 10 * 0.5) / 40)
