"""``selection="query"``: blocks ranked by the question's attention (ProphetKV), on the tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch

import benchmarks.selections.query as query_module
from benchmarks.selections.query import block_scores, fused_attention, question_blocks
from kvrag import InvalidRequestError
from kvrag.engine.reuse.selection import ProbeParams, params_class, selection_params
from tests.helpers import PREFIX, SUFFIX, last_logits, make_docs


def test_each_layer_weighs_the_same_in_the_fused_attention():
    # layer 0 puts 10x the mass of layer 1 on the keys: normalised, both count the same
    fused = fused_attention([torch.tensor([10.0, 0.0, 10.0]), torch.tensor([0.0, 1.0, 1.0])])
    assert torch.allclose(fused, torch.tensor([0.25, 0.25, 0.5]))
    assert float(fused.sum()) == pytest.approx(1.0)


def test_blocks_score_the_attention_on_their_tokens_and_are_taken_whole_in_that_order():
    spans = [(4, 24), (30, 40)]  # blocks of 8: [4,12) [12,20) [20,24) | [30,38) [38,40)
    keys = torch.tensor(list(range(4, 24)) + list(range(30, 40)))
    attention = torch.zeros(keys.numel())
    attention[keys == 13] = 0.5  # block [12,20)
    attention[keys == 31] = 0.3  # block [30,38)
    attention[keys == 39] = 0.2  # block [38,40)
    blocks = block_scores(spans, 8, keys, attention)
    assert [(a, b) for _, a, b in blocks] == [(4, 12), (12, 20), (20, 24), (30, 38), (38, 40)]
    assert [s for s, _, _ in blocks] == pytest.approx([0.0, 0.5, 0.0, 0.3, 0.2])
    # budget 12: [12,20) whole, then the first 4 of [30,38)
    chosen = question_blocks(48, blocks, 12)
    assert chosen.nonzero().squeeze(1).tolist() == list(range(12, 20)) + list(range(30, 34))
    assert int(question_blocks(48, blocks, 100).sum()) == 30  # everything cached, never more


def test_query_takes_the_probes_block_size_and_its_depth():
    assert issubclass(params_class("query"), ProbeParams)
    assert selection_params("query", {"query_layers": 12, "probe_stride": 8}).resolved(30).query_layers == 12
    assert selection_params("query").resolved(30).query_layers == 22  # three quarters of the depth by default
    assert selection_params("query", {"query_layers": 99}).resolved(30).query_layers == 29
    with pytest.raises(InvalidRequestError, match="query_layers"):
        selection_params("query", {"query_layers": 0})
    with pytest.raises(InvalidRequestError, match="'query' takes no parameter"):
        selection_params("query", {"query_deviation_weight": 1.0})


def test_query_spends_the_budget_on_the_blocks_the_question_reads(tiny_engine, monkeypatch):
    chunks = make_docs(4, words=60, seed=7)
    tiny_engine.warm(chunks)
    seen = {}
    real = query_module.question_blocks

    def spy(n, blocks, budget):
        seen.update(blocks=blocks, budget=budget)
        return real(n, blocks, budget)

    monkeypatch.setattr(query_module, "question_blocks", spy)
    g = tiny_engine.generate(chunks[::-1], PREFIX, SUFFIX, selection="query", recompute_ratio=0.3, max_new_tokens=1)
    cached = g.stats.cached_tokens - g.stats.prefix_tokens
    assert seen["budget"] == math.ceil(0.3 * cached) == g.stats.recomputed_tokens
    scores = [s for s, _, _ in seen["blocks"]]
    assert min(scores) >= 0 and sum(scores) == pytest.approx(1.0, abs=1e-4)  # shares of the fused attention
    assert len(set(scores)) > 1  # the question reads some blocks more than others


def test_query_at_ratio_one_is_the_full_prefill_exactly(tiny_engine):
    chunks = make_docs(4, seed=11)
    tiny_engine.warm(chunks)
    order = [chunks[i] for i in (2, 0, 3, 1)]
    assert torch.equal(last_logits(tiny_engine, order, "blend", 1.0, "query"), last_logits(tiny_engine, order, "full"))


def test_the_first_stage_measures_the_layers_asked_for(tiny_model, tiny_tokenizer, monkeypatch):
    from kvrag import Engine

    depths = []
    real = query_module.fused_attention
    monkeypatch.setattr(
        query_module, "fused_attention", lambda by_layer: depths.append(len(by_layer)) or real(by_layer)
    )
    chunks = make_docs(3, seed=3)
    for layers in (1, 99):
        engine = Engine.from_model(
            tiny_model, tiny_tokenizer, selection="query", selection_params={"query_layers": layers}, tree_refresh=False
        )
        engine.warm(chunks)
        engine.generate(chunks[::-1], PREFIX, SUFFIX, recompute_ratio=0.3, max_new_tokens=1)
        engine.close()
    assert depths == [1, tiny_model.config.num_hidden_layers - 1]  # layers 1..last: layer 0 reads no context


@pytest.mark.parametrize("gap", [False, True])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("first", [30, 33])
def test_the_question_meter_measures_what_the_block_probe_does_bit_for_bit(gap, window, first):
    from types import SimpleNamespace

    from kvrag.engine.reuse.selection.probe import BlockProbe

    torch.manual_seed(0)
    n, h, hkv, d = 40, 4, 2, 8
    buf = SimpleNamespace(k=torch.randn(3, hkv, n, d, dtype=torch.bfloat16))
    keys = torch.tensor([p for p in range(4, 30) if not (gap and 14 <= p < 17)])  # one run of positions, or two
    pos = torch.arange(first, n)  # from 30: rows before the question's (their attention is not measured)
    question = torch.zeros(n, dtype=torch.bool)
    question[33:] = True
    windows = [None, window, None]
    probe = BlockProbe(torch.zeros(n, dtype=torch.bool), 2, question=question, keys=keys, scale=0.3, windows=windows)
    meter = query_module.QuestionMeter(question, keys, 2, 0.3, windows)
    assert [meter.wants(layer) for layer in range(3)] == [False, True, True]
    for layer in (1, 2):
        q = torch.randn(h, pos.numel(), d, dtype=torch.bfloat16)
        probe._attend(layer, pos, q, buf)
        keep = meter.select(layer, pos, q, None, None, buf)
        assert keep is None if layer == 1 else keep.numel() == 0  # the pass ends on the last layer measured
    assert len(meter.by_layer) == 2
    assert all(torch.equal(a, b) for a, b in zip(probe.by_layer, meter.by_layer))
