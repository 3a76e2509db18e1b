"""Which cached tokens blend recomputes: the probe's and EPIC's budgets, on the tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch

import kvrag.engine.reuse.selection.probe as probe_module
from kvrag import InvalidRequestError
from kvrag.config import EngineConfig
from kvrag.engine.reuse.selection import (
    HKVDParams,
    ProbeParams,
    configured_params,
    epic_shares,
    epic_tokens,
    probe_blocks,
    probe_sample,
)
from tests.helpers import PREFIX, SUFFIX, last_logits, make_docs


def test_probe_blocks_spend_the_budget_on_whole_blocks_by_deviation():
    spans = [(0, 40), (40, 60)]  # blocks of 16: [0,16) [16,32) [32,40) | [40,56) [56,60)
    sample = probe_sample(spans, 64, 16)
    positions = sample.nonzero().squeeze(1)
    assert positions.tolist() == [8, 24, 36, 48, 58]  # each block's middle token
    deviation = torch.tensor([0.5, 3.0, 1.0, 2.0, 0.0])
    # budget ceil(0.5 * 60) = 30: [16,32) whole (16), then the first 14 of [40,56)
    chosen = probe_blocks(spans, 64, 16, positions, deviation, math.ceil(0.5 * 60))
    assert chosen.nonzero().squeeze(1).tolist() == list(range(16, 32)) + list(range(40, 54))
    assert int(probe_blocks(spans, 64, 16, positions, deviation, math.ceil(0.15 * 60)).sum()) == math.ceil(0.15 * 60)
    # all of it: every block that changed at all; never the zero-deviation one (KV cached in this
    # very context)
    everything = probe_blocks(spans, 64, 16, positions, deviation, 60)
    assert everything.nonzero().squeeze(1).tolist() == list(range(0, 56))


def test_probe_sample_takes_the_middle_of_every_block_short_ones_too():
    sample = probe_sample([(2, 40), (40, 43)], 50, 16)
    assert sample.nonzero().squeeze(1).tolist() == [10, 26, 37, 41]  # [2,18) [18,34) [34,40) | [40,43)


def test_probe_layer_defaults_to_a_quarter_of_the_depth_and_is_validated():
    assert ProbeParams().resolved(30).probe_layer == 8
    assert ProbeParams().resolved(2).probe_layer == 1
    assert ProbeParams(probe_layer=50).resolved(6).probe_layer == 5
    assert configured_params(EngineConfig(selection_params={"probe_layer": 50})).resolved(6).probe_layer == 5
    for bad in ({"probe_layer": 0}, {"probe_layer": True}, {"probe_layer": 2.5}):
        with pytest.raises(InvalidRequestError, match="probe_layer"):
            ProbeParams(**bad)
    for bad in (0, -1, 1.5, "16"):
        with pytest.raises(InvalidRequestError, match="probe_stride"):
            ProbeParams(probe_stride=bad)
    with pytest.raises(InvalidRequestError, match="deviation"):
        ProbeParams(deviation="q")


def test_hkvd_schedule_and_check_layer_are_validated():
    assert HKVDParams(filter_schedule=[3, 2.0]).filter_schedule == (3.0, 2.0)  # a JSON list becomes floats
    assert HKVDParams().filter_schedule == (2.0, 1.5) and HKVDParams(filter_schedule=()).filter_schedule == ()
    for bad in ((1.5, 2.0), (0.5,), "2,1", (2.0, None), (True,)):
        with pytest.raises(InvalidRequestError, match="filter_schedule"):
            HKVDParams(filter_schedule=bad)
    for bad in (0, -1, True, 1.0):
        with pytest.raises(InvalidRequestError, match="check_layer"):
            HKVDParams(check_layer=bad)


def test_probe_recomputes_the_blocks_it_measured_most_changed(tiny_engine, monkeypatch):
    chunks = make_docs(4, seed=3)
    tiny_engine.warm(chunks)
    seen = []
    original = probe_module.probe_blocks

    def spy(spans, n, stride, positions, deviation, budget, threshold=0.0, chosen=None):
        chosen = original(spans, n, stride, positions, deviation, budget, threshold, chosen)
        seen.append((spans, positions, deviation, chosen))
        return chosen

    monkeypatch.setattr(probe_module, "probe_blocks", spy)
    order = [chunks[i] for i in (2, 0, 3, 1)]
    g = tiny_engine.generate(order, PREFIX, SUFFIX, selection="probe", recompute_ratio=0.3, max_new_tokens=1)
    ((spans, positions, deviation, chosen),) = seen
    cached = sum(b - a for a, b in spans)
    assert positions.numel() == sum(math.ceil((b - a) / 16) for a, b in spans)  # one per block, all measured
    assert bool((deviation > 0).all())
    assert g.stats.recomputed_tokens == int(chosen.sum()) == math.ceil(0.3 * cached)
    assert bool(chosen[int(positions[deviation.argmax()])])  # the most changed block is recomputed
    # no row is computed twice: the uncached rows and the chosen blocks once through every layer,
    # the sample up to the probe layer
    layers = tiny_engine.adapter.n_layers
    probe_layer = configured_params(tiny_engine.config, "probe").resolved(layers).probe_layer
    uncached = g.stats.prompt_tokens - g.stats.cached_tokens
    assert round(g.stats.compute_fraction * g.stats.prompt_tokens * layers) == (
        (uncached + int(chosen.sum())) * layers + positions.numel() * probe_layer
    )


def test_focused_chunks_cut_where_cache_crafts_entropy_grows_fastest():
    from kvrag.engine.reuse.selection.focus import focused_chunks

    assert focused_chunks([0.1, 5.0, 0.2, 0.15]) == [1]  # one chunk stands out
    assert sorted(focused_chunks([3.0, 0.1, 2.9, 0.2, 0.1, 0.05])) == [0, 2]
    assert focused_chunks([1.0, 1.0]) == [0] and focused_chunks([]) == []


def test_focus_recomputes_whole_the_chunks_the_question_reads(tiny_engine, monkeypatch):
    """The budget goes to whole chunks in order of the question's attention (measured by the
    probe's first pass over the cached KV); the rest to the most deviated blocks."""
    import kvrag.engine.reuse.selection.focus as focus_module

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
    from kvrag.engine.reuse.selection.craft import craft_budgets

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


@pytest.mark.parametrize("selection", ["probe", "focus", "hkvd"])
def test_a_layer_placed_again_puts_back_only_what_a_pass_computed_over(tiny_engine, monkeypatch, selection):
    """The probe's passes run the first layers twice; the second placement restores the positions the
    first pass computed over instead of placing the layer whole: the same logits, bit for bit."""
    from kvrag.engine.reuse import fusion

    chunks = make_docs(4, seed=5)
    tiny_engine.warm(chunks)
    order = [chunks[i] for i in (3, 1, 0, 2)]
    restored = []
    restore = fusion.SpanSource._restore
    monkeypatch.setattr(
        fusion.SpanSource, "_restore", lambda s, layer, buf: restored.append(layer) or restore(s, layer, buf)
    )
    fast = last_logits(tiny_engine, order, "blend", 0.3, selection)
    assert restored or selection == "hkvd"  # hkvd runs each layer once

    def fill_whole(self, layer, buf):  # every pass places the layer whole, as before
        self._placed.discard(layer)
        return fill(self, layer, buf)

    fill = fusion.SpanSource.fill
    monkeypatch.setattr(fusion.SpanSource, "fill", fill_whole)
    assert torch.equal(last_logits(tiny_engine, order, "blend", 0.3, selection), fast)
