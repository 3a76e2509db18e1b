"""Which cached tokens blend recomputes: the probe selection's chunk budgets, on the tiny Llama."""

from __future__ import annotations

import math

import pytest

import kvrag.engine.fusion as fusion
from kvrag import InvalidRequestError
from kvrag.config import EngineConfig
from kvrag.engine.selection import chunk_quotas, probe_sample
from tests.helpers import make_docs
from tests.test_engine import PREFIX, SUFFIX


def test_chunk_quotas_spend_the_budget_on_whole_chunks_by_deviation():
    sizes = [100, 80, 120, 60]
    deviation = {0: 0.5, 1: 3.0, 2: 1.0, 3: 2.0}
    # budget ceil(0.5 * 360) = 180: chunk 1 (80) whole, chunk 3 (60) whole, 40 of chunk 2, none of 0
    assert chunk_quotas(sizes, deviation, 0.5) == {1: 80, 3: 60, 2: 40}
    assert sum(chunk_quotas(sizes, deviation, 0.15).values()) == math.ceil(0.15 * 360)
    assert chunk_quotas(sizes, deviation, 1.0) == dict(enumerate(sizes))


def test_chunk_quotas_give_nothing_to_unchanged_chunks():
    # a chunk cached in this very context has zero deviation: nothing to fix there
    assert chunk_quotas([50, 50], {0: 0.0, 1: 0.2}, 0.9) == {1: 50}
    assert chunk_quotas([50, 50], {0: 0.0, 1: 0.0}, 0.5) == {}


def test_probe_sample_takes_every_stride_th_token_and_one_of_each_short_chunk():
    sample = probe_sample([(2, 40), (40, 43)], 50, 16)
    assert sample.nonzero().squeeze(1).tolist() == [10, 26, 42]  # offsets 8, 24 in the first; the last of a 3-token one


def test_probe_layer_defaults_to_a_quarter_of_the_depth_and_is_validated():
    assert EngineConfig().resolved_probe_layer(30) == 8
    assert EngineConfig().resolved_probe_layer(2) == 1
    assert EngineConfig(probe_layer=50).resolved_probe_layer(6) == 5
    with pytest.raises(InvalidRequestError, match="probe_layer"):
        EngineConfig(probe_layer=0)
    with pytest.raises(InvalidRequestError, match="probe_stride"):
        EngineConfig(probe_stride=0)


def test_probe_recomputes_whole_chunks_in_order_of_their_probed_deviation(tiny_engine, monkeypatch):
    chunks = make_docs(4, seed=3)
    tiny_engine.warm(chunks)
    seen = []
    original = fusion.chunk_quotas

    def spy(sizes, deviation, ratio):
        quotas = original(sizes, deviation, ratio)
        seen.append((sizes, deviation, quotas))
        return quotas

    monkeypatch.setattr(fusion, "chunk_quotas", spy)
    order = [chunks[i] for i in (2, 0, 3, 1)]
    g = tiny_engine.generate(order, PREFIX, SUFFIX, selection="probe", recompute_ratio=0.3, max_new_tokens=1)
    (sizes, deviation, quotas), = seen
    assert set(deviation) == set(range(4)) and all(d > 0 for d in deviation.values())
    ranked = sorted(deviation, key=deviation.get, reverse=True)
    budget = math.ceil(0.3 * sum(sizes))
    assert g.stats.recomputed_tokens == sum(quotas.values()) == budget
    assert quotas[ranked[0]] == min(sizes[ranked[0]], budget)  # the most changed chunk first, whole
    assert list(quotas) == ranked[: len(quotas)]

