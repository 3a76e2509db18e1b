"""The research selections the benchmarks register (``hkvd``, ``focus``, ``craft``, ``epic``), on the tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch

import benchmarks.selections.focus as focus_module
from benchmarks.selections import HKVDParams, craft_budgets, epic_shares, epic_tokens, focused_chunks
from kvrag import InvalidRequestError
from tests.helpers import PREFIX, SUFFIX, kl_by_ratio, last_logits, make_docs, placed_again


def test_hkvd_schedule_and_check_layer_are_validated():
    assert HKVDParams(filter_schedule=[3, 2.0]).filter_schedule == (3.0, 2.0)  # a JSON list becomes floats
    assert HKVDParams().filter_schedule == (2.0, 1.5) and HKVDParams(filter_schedule=()).filter_schedule == ()
    for bad in ((1.5, 2.0), (0.5,), "2,1", (2.0, None), (True,)):
        with pytest.raises(InvalidRequestError, match="filter_schedule"):
            HKVDParams(filter_schedule=bad)
    for bad in (0, -1, True, 1.0):
        with pytest.raises(InvalidRequestError, match="check_layer"):
            HKVDParams(check_layer=bad)


def test_focused_chunks_cut_where_cache_crafts_entropy_grows_fastest():
    assert focused_chunks([0.1, 5.0, 0.2, 0.15]) == [1]  # one chunk stands out
    assert sorted(focused_chunks([3.0, 0.1, 2.9, 0.2, 0.1, 0.05])) == [0, 2]
    assert focused_chunks([1.0, 1.0]) == [0] and focused_chunks([]) == []


def test_focus_recomputes_whole_the_chunks_the_question_reads(tiny_engine, monkeypatch):
    """The budget goes to whole chunks in order of the question's attention (measured by the
    probe's first pass over the cached KV); the rest to the most deviated blocks."""
    chunks = make_docs(4, words=60, seed=5)
    tiny_engine.warm(chunks)
    seen = {}
    original = focus_module._chunk_attention

    def spy(p, meter):
        attention, focused = original(p, meter)
        seen.update(
            spans=p.spans, attention=attention, budget=math.ceil(p.budget.share * sum(b - a for a, b in p.spans))
        )
        return attention, focused

    monkeypatch.setattr(focus_module, "_chunk_attention", spy)
    g = tiny_engine.generate(chunks[::-1], PREFIX, SUFFIX, selection="focus", recompute_ratio=0.4, max_new_tokens=1)
    first = max(range(4), key=lambda i: seen["attention"][i])
    a, b = seen["spans"][first]
    assert b - a <= seen["budget"]  # 60-word chunks: one fits a 40% budget whole
    assert g.stats.recomputed_tokens == seen["budget"]
    assert all(x >= 0 for x in seen["attention"]) and len(seen["attention"]) == 4


def test_craft_shares_the_budget_by_fix_overhead_and_size():
    assert craft_budgets([100, 100, 50], [0.5, 0.0, 1.0], 40) == [20, 0, 20]
    assert craft_budgets([10, 100], [1.0, 1.0], 50) == [4, 46]  # by fix x size; the remainder to the biggest
    assert craft_budgets([10, 100], [1.0, 0.05], 50) == [10, 40]  # never more than a chunk has: the rest moves on
    assert sum(craft_budgets([30, 30, 30], [0.3, 0.3, 0.3], 10)) == 10
    assert craft_budgets([10], [0.0], 5) == [0]


def test_craft_recomputes_the_chunks_blocks_its_statistics_rank_first(tiny_engine):
    chunks = make_docs(4, words=60, seed=6)
    tiny_engine.warm(chunks)
    g = tiny_engine.generate(chunks[::-1], PREFIX, SUFFIX, selection="craft", recompute_ratio=0.3, max_new_tokens=1)
    cached = sum(c.tokens for c in g.stats.chunks if c.source == "store")
    assert g.stats.recomputed_tokens == math.ceil(0.3 * cached)
    assert all(c.fix is not None and 0 < c.fix <= 1 for c in g.stats.chunks)


def test_epic_splits_the_budget_evenly_over_the_chunks_first_tokens():
    spans = [(0, 40), (40, 60), (60, 64)]  # 64 cached tokens; budget ceil(0.5 * 64) = 32
    # the 4-token chunk gives all it has (4 of its share of 11); 28 left for two: 14 each
    assert epic_shares([40, 20, 4], 32) == [14, 14, 4]
    chosen = epic_tokens(spans, 70, 0.5)
    assert chosen.nonzero().squeeze(1).tolist() == list(range(0, 14)) + list(range(40, 54)) + list(range(60, 64))
    # ceil(0.15 * 64) = 10 over three chunks: 4, 3, 3 (the shortest gets the odd token)
    assert epic_shares([40, 20, 4], 10) == [3, 3, 4]
    assert int(epic_tokens(spans, 70, 0.15).sum()) == 10
    assert epic_tokens(spans, 70, 1.0)[:64].all() and not epic_tokens(spans, 70, 1.0)[64:].any()
    assert epic_shares([5, 5], 100) == [5, 5] and epic_shares([], 3) == []


def test_epic_recomputes_each_cached_chunks_first_tokens(tiny_engine):
    chunks = make_docs(4, seed=5)
    tiny_engine.warm(chunks)
    order = [chunks[i] for i in (1, 3, 0, 2)]
    g = tiny_engine.generate(order, PREFIX, SUFFIX, selection="epic", recompute_ratio=0.2, max_new_tokens=1)
    spans = [(c.start, c.start + c.tokens) for c in g.stats.chunks]
    assert all(c.source == "store" for c in g.stats.chunks)
    cached = sum(b - a for a, b in spans)
    assert g.stats.recomputed_tokens == math.ceil(0.2 * cached)
    # one pass: the uncached rows and each chunk's first tokens through every layer, nothing else
    uncached = g.stats.prompt_tokens - g.stats.cached_tokens
    layers = tiny_engine.adapter.n_layers
    assert (
        round(g.stats.compute_fraction * g.stats.prompt_tokens * layers)
        == (uncached + math.ceil(0.2 * cached)) * layers
    )


def test_epic_at_ratio_one_and_with_every_token_budgeted_is_the_full_prefill(tiny_engine, docs):
    tiny_engine.warm(docs)
    full = tiny_engine.generate(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=8)
    one = tiny_engine.generate(docs, PREFIX, SUFFIX, selection="epic", recompute_ratio=1.0, max_new_tokens=8)
    assert one.token_ids == full.token_ids
    assert torch.equal(last_logits(tiny_engine, docs, "blend", 1.0, "epic"), last_logits(tiny_engine, docs, "full"))
    # a ratio just under 1.0 still budgets every cached token: epic's own pass recomputes them all
    nearly = tiny_engine.generate(docs, PREFIX, SUFFIX, selection="epic", recompute_ratio=0.9999, max_new_tokens=8)
    assert nearly.stats.path == "blend"  # a prompt this short is not priced (kvrag.engine.reuse.paths)
    assert nearly.stats.recomputed_tokens == nearly.stats.cached_tokens - nearly.stats.prefix_tokens > 0
    assert nearly.token_ids == full.token_ids
    torch.testing.assert_close(
        last_logits(tiny_engine, docs, "blend", 0.9999, "epic"), last_logits(tiny_engine, docs, "full")
    )


@pytest.mark.parametrize("selection", ["focus", "hkvd"])
def test_a_layer_placed_again_puts_back_only_what_a_pass_computed_over(tiny_engine, monkeypatch, selection):
    """The probe's passes (``focus`` runs them) run the first layers twice; the second placement restores
    the positions the first pass computed over instead of placing the layer whole: the same logits, bit
    for bit."""
    restored, fast, whole = placed_again(tiny_engine, monkeypatch, selection)
    assert restored or selection == "hkvd"  # hkvd runs each layer once
    assert torch.equal(whole, fast)


@pytest.mark.parametrize("selection", ["hkvd", "focus", "craft"])
def test_deviation_from_full_shrinks_as_ratio_grows(tiny_engine, selection):
    errors = kl_by_ratio(tiny_engine, selection)
    assert errors[1.0] == 0.0
    assert errors[0.0] > errors[0.2] > errors[0.5] > errors[1.0]
