"""Which cached tokens blend recomputes: HKVD by deviation, and the same filtering by question attention."""

from __future__ import annotations

import math

import pytest
import torch

from kvrag import InvalidRequestError
from kvrag.engine.runner import KVBuffer
from kvrag.engine.selection import HKVDSelector, question_attention
from tests.helpers import make_docs
from tests.test_engine import PREFIX, SUFFIX


def _softmax_math(q, pos, k, keys, rows, scale):
    """The question's mean attention written out head by head (the oracle)."""
    full = keys.clone()
    full[:, pos] = k
    group = q.shape[0] // keys.shape[0]
    n = int(pos[rows[-1]]) + 1
    total = torch.zeros(keys.shape[1])
    for h in range(q.shape[0]):
        for r in rows.tolist():
            p = int(pos[r])
            w = torch.softmax((full[h // group, : p + 1] @ q[h, r]) * scale, dim=0)
            total[: p + 1] += w
    return total / (q.shape[0] * rows.numel()), n


def test_question_attention_matches_softmax_math():
    torch.manual_seed(0)
    hkv, group, s, d = 2, 3, 40, 8
    keys = torch.randn(hkv, s, d)
    pos = torch.tensor([3, 7, 8, 20, 30, 31, 32, 33])  # computed rows; the last three ask
    q, k = torch.randn(hkv * group, pos.numel(), d), torch.randn(hkv, pos.numel(), d)
    rows = torch.tensor([5, 6, 7])
    got = question_attention(q, pos, k, keys, rows, 0.5)
    want, n = _softmax_math(q, pos, k, keys, rows, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(got[n:].sum()) == 0.0 and math.isclose(float(got.sum()), 1.0, rel_tol=1e-5)
    assert torch.equal(keys, keys.clone())  # the layer's keys are not modified


def _selector_inputs(hot: int):
    """Ten cached positions, two question rows; the question's queries point at position ``hot``."""
    torch.manual_seed(1)
    n, d = 12, 4
    candidates = torch.zeros(n, dtype=torch.bool)
    candidates[:10] = True
    question = ~candidates
    pos = torch.arange(n)
    k = torch.randn(1, n, d) * 0.1
    k[0, hot] = torch.tensor([4.0, 0, 0, 0])
    q = torch.zeros(1, n, d)
    q[0, 10:, 0] = 4.0
    v = torch.randn(1, n, d)
    buf = type("Buf", (), {})()
    buf.k, buf.v = k[None].clone(), v[None].clone()
    buf.k[0, 0, :10] += torch.randn(10, d) * torch.linspace(1, 2, 10)[:, None]  # deviation grows with position
    return candidates, question, pos, q, k, v, buf


@pytest.mark.parametrize("hot", [0, 4])
def test_attention_rank_keeps_the_token_the_question_reads(hot):
    candidates, question, pos, q, k, v, buf = _selector_inputs(hot)
    by_attention = HKVDSelector(candidates, 0.1, {0: 0.1}, rank="attention", question=question, scale=1.0)
    by_deviation = HKVDSelector(candidates, 0.1, {0: 0.1}, rank="deviation", question=question, scale=1.0)
    by_attention.select(0, pos, q, k, v, buf)
    by_deviation.select(0, pos, q, k, v, buf)
    assert by_attention.selected.tolist() == [hot]
    assert by_deviation.selected.tolist() != [hot]  # the largest deviation sits elsewhere


def test_attention_rank_without_a_question_falls_back_to_deviation():
    candidates, _, pos, q, k, v, buf = _selector_inputs(0)
    none = torch.zeros_like(candidates)
    a = HKVDSelector(candidates, 0.2, {0: 0.2}, rank="attention", question=none)
    b = HKVDSelector(candidates, 0.2, {0: 0.2}, rank="deviation")
    assert torch.equal(a.select(0, pos, q, k, v, buf), b.select(0, pos, q, k, v, buf))


def test_unknown_rank_is_refused():
    with pytest.raises(ValueError, match="rank"):
        HKVDSelector(torch.ones(3, dtype=torch.bool), 0.5, {1: 0.5}, rank="random")


def _last_logprobs(engine, chunks, ratio, selection):
    req = engine._request(chunks, PREFIX, SUFFIX, 0, 0.0, 1.0, None, None, "blend", ratio, selection=selection)
    _, res = engine._prefill(req, capacity=int(req.ids.shape[0]))
    return res, torch.log_softmax(engine.adapter.logits(res.last_hidden)[0], -1)


def test_attention_selection_in_the_engine(tiny_engine):
    """Same budget as HKVD, exact at ratio 1.0, closer to full prefill as the ratio grows."""
    errors = {r: 0.0 for r in (0.0, 0.2, 0.5, 1.0)}
    for seed in range(3):
        chunks = make_docs(4, seed=seed + 20)
        tiny_engine.warm(chunks)
        full = tiny_engine.generate(chunks, PREFIX, SUFFIX, mode="full", max_new_tokens=6)
        _, ref = _last_logprobs(tiny_engine, chunks, 1.0, "hkvd")
        for r in errors:
            res, got = _last_logprobs(tiny_engine, chunks, r, "attention")
            errors[r] += float((ref.exp() * (ref - got)).sum())
            if 0 < r < 1:
                g = tiny_engine.generate(chunks, PREFIX, SUFFIX, recompute_ratio=r, selection="attention")
                h = tiny_engine.generate(chunks, PREFIX, SUFFIX, recompute_ratio=r, selection="hkvd")
                assert g.stats.recomputed_tokens == h.stats.recomputed_tokens > 0
        one = tiny_engine.generate(chunks, PREFIX, SUFFIX, recompute_ratio=1.0, selection="attention", max_new_tokens=6)
        assert one.token_ids == full.token_ids
    assert errors[1.0] == 0.0
    assert errors[0.0] > errors[0.2] > errors[0.5] > errors[1.0]


def test_unknown_selection_is_refused(tiny_engine, docs):
    with pytest.raises(InvalidRequestError, match="attention"):
        tiny_engine.generate(docs, PREFIX, SUFFIX, selection="oracle")
