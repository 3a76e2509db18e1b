"""Cache-Craft's attention statistics of a chunk, checked against transformers' own attention weights."""

from __future__ import annotations

import math

import torch

from kvrag.engine.model.runner import KVBuffer, forward
from kvrag.engine.reuse.attention_stats import ContextSpan, Tap, block_middles, chunk_statistics
from kvrag.engine.reuse.variants import VariantInfo
from tests.helpers import make_docs


def _hf_attentions(engine, ids: list[int]) -> list[torch.Tensor]:
    """Per layer [H, T, T] attention probabilities from transformers' eager attention."""
    model = engine.hf_model
    before = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        model.config._attn_implementation = before
    return [a[0].float() for a in out.attentions]


def test_statistics_match_transformers_attention(tiny_engine):
    docs = [tiny_engine.prompt_tokenizer.tokenize(d) for d in make_docs(3, words=40, seed=41)]
    ids = [tiny_engine.tokenizer.bos_token_id] + docs[0] + docs[1] + docs[2]
    a, b = 1 + len(docs[0]), 1 + len(docs[0]) + len(docs[1])
    chunk = (b, len(ids))
    context = [ContextSpan(1, a, "d0"), ContextSpan(a, b, "d1")]
    stride = 4
    tap = Tap(block_middles(*chunk, stride), tiny_engine.adapter.n_layers)
    n = len(ids)
    buf = KVBuffer(tiny_engine.adapter, n)
    forward(tiny_engine.adapter, buf, torch.tensor(ids), torch.arange(n), n, taps=[tap])
    stats = chunk_statistics(tap, buf, chunk, context, tiny_engine.adapter.scale, stride)

    # the same figures from transformers' attention weights, at the same sampled queries
    middles = block_middles(*chunk, stride)
    size, per_query = chunk[1] - chunk[0], (chunk[1] - chunk[0]) / len(middles)
    a_layers, b_layers, mass = [], [], torch.zeros(2)
    for att in _hf_attentions(tiny_engine, ids):
        w = att.mean(dim=0)[middles]  # [S, T] averaged over heads
        inter = [float(w[:, s.start : s.end].sum()) * per_query for s in context]
        mass += torch.tensor(inter)
        a_layers.append(sum(x / (size * (s.end - s.start)) for x, s in zip(inter, context)))
        b_layers.append(float(w[:, chunk[0] : chunk[1]].sum()) * per_query / size**2)
    cci = 1 / (1 + math.exp(-(sum(a_layers) / len(a_layers)) / (sum(b_layers) / len(b_layers))))
    assert stats is not None and 0.5 < stats.cci < 1.0
    assert abs(stats.cci - cci) < 1e-4
    assert torch.allclose(torch.tensor(stats.weights), mass / mass.sum(), atol=1e-4)
    assert stats.block_inter.shape == (len(middles),)


def test_warmed_and_written_back_chunks_carry_their_statistics(tiny_engine):
    docs = make_docs(3, words=60, seed=42)
    tiny_engine.warm(docs[:2])
    ids = tiny_engine.prompt_tokenizer.tokenize(docs[1])
    rec = tiny_engine.store.get(tiny_engine.planner.chunk_key(ids), ids)
    info = VariantInfo.from_record(tiny_engine.planner.chunk_key(ids), rec)
    assert info.cci is not None and 0 < info.cci < 1 and info.weights is not None
    assert abs(sum(info.weights) - 1) < 1e-6 and len(info.weights) == len(info.context)
    assert rec.stats["block_inter"].shape[0] == math.ceil(len(ids) / 16)
    # a chunk a request missed: measured from the request's own queries, behind the prompt's chunks
    g = tiny_engine.generate(docs, "Answer from the documents.\n", "Question: why?\n", max_new_tokens=1)
    assert [c.hit for c in g.stats.chunks] == [True, True, False]
    tiny_engine.flush()
    ids = tiny_engine.prompt_tokenizer.tokenize(docs[2])
    info = tiny_engine.variants.index.variants(tiny_engine.planner.chunk_key(ids))[0]
    assert info.cci is not None and len(info.context) == 2 and info.weights is not None
