"""``selection="query"``: blocks ranked by the question's attention (ProphetKV), on the tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch

import kvrag.engine.reuse.selection.query as query_module
from kvrag import InvalidRequestError
from kvrag.engine.reuse.selection import params_class, selection_params
from kvrag.engine.reuse.selection.query import QueryParams, fused_attention, query_scores
from tests.helpers import PREFIX, SUFFIX, last_logits, make_docs


def test_each_layer_weighs_the_same_in_the_fused_attention():
    # layer 0 puts 10x the mass of layer 1 on the keys: normalised, both count the same
    fused = fused_attention([torch.tensor([10.0, 0.0, 10.0]), torch.tensor([0.0, 1.0, 1.0])])
    assert torch.allclose(fused, torch.tensor([0.25, 0.25, 0.5]))
    assert float(fused.sum()) == pytest.approx(1.0)


def test_a_block_scores_the_attention_on_its_tokens_times_its_deviation_to_the_weight():
    spans = [(4, 24), (30, 40)]  # blocks of 8: [4,12) [12,20) [20,24) | [30,38) [38,40)
    keys = torch.tensor(list(range(4, 24)) + list(range(30, 40)))
    attention = torch.zeros(keys.numel())
    attention[keys == 13] = 0.5  # block [12,20)
    attention[keys == 31] = 0.3  # block [30,38)
    attention[keys == 39] = 0.2  # block [38,40)
    deviation = torch.tensor([1.0, 1.0, 1.0, 2.0, 0.0])
    alone = query_scores(spans, 8, keys, attention, deviation, 0.0)
    assert alone.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.3, 0.0])  # zero deviation: nothing to fix
    both = query_scores(spans, 8, keys, attention, deviation, 1.0)
    assert both.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.6, 0.0])


def test_query_takes_the_probes_parameters_and_its_own_weight():
    assert issubclass(params_class("query"), QueryParams)
    p = selection_params("query", {"probe_layer": 3, "query_deviation_weight": 1.0})
    assert p.resolved(30).probe_layer == 3 and p.query_deviation_weight == 1.0
    with pytest.raises(InvalidRequestError, match="query_deviation_weight"):
        selection_params("query", {"query_deviation_weight": -1})


def test_query_spends_the_budget_on_the_blocks_the_question_reads(tiny_engine, monkeypatch):
    chunks = make_docs(4, words=60, seed=7)
    tiny_engine.warm(chunks)
    seen = {}
    real = query_module.probe_blocks

    def spy(spans, n, stride, positions, score, budget, *rest):
        seen.update(score=score.clone(), budget=budget)
        return real(spans, n, stride, positions, score, budget, *rest)

    monkeypatch.setattr(query_module, "probe_blocks", spy)
    order = chunks[::-1]
    g = tiny_engine.generate(order, PREFIX, SUFFIX, selection="query", recompute_ratio=0.3, max_new_tokens=1)
    cached = g.stats.cached_tokens - g.stats.prefix_tokens
    assert seen["budget"] == math.ceil(0.3 * cached)
    assert g.stats.recomputed_tokens == seen["budget"]  # other order: every block deviates, some attended
    assert (seen["score"] > 0).any() and float(seen["score"].sum()) <= 1.0 + 1e-5  # shares of the fused attention


def test_query_at_ratio_one_is_the_full_prefill_exactly(tiny_engine):
    chunks = make_docs(4, seed=11)
    tiny_engine.warm(chunks)
    order = [chunks[i] for i in (2, 0, 3, 1)]
    assert torch.equal(last_logits(tiny_engine, order, "blend", 1.0, "query"), last_logits(tiny_engine, order, "full"))
