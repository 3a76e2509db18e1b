"""Which cached tokens blend recomputes: the probe selection's chunk budgets, on the tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch

import kvrag.engine.selection.probe as probe_module
from kvrag import InvalidRequestError
from kvrag.config import EngineConfig
from kvrag.engine.selection import probe_blocks, probe_sample
from tests.helpers import PREFIX, SUFFIX, make_docs


def test_probe_blocks_spend_the_budget_on_whole_blocks_by_deviation():
    spans = [(0, 40), (40, 60)]  # blocks of 16: [0,16) [16,32) [32,40) | [40,56) [56,60)
    sample = probe_sample(spans, 64, 16)
    positions = sample.nonzero().squeeze(1)
    assert positions.tolist() == [8, 24, 36, 48, 58]  # each block's middle token
    deviation = torch.tensor([0.5, 3.0, 1.0, 2.0, 0.0])
    # budget ceil(0.5 * 60) = 30: [16,32) whole (16), then the first 14 of [40,56)
    chosen = probe_blocks(spans, 64, 16, positions, deviation, 0.5)
    assert chosen.nonzero().squeeze(1).tolist() == list(range(16, 32)) + list(range(40, 54))
    assert int(probe_blocks(spans, 64, 16, positions, deviation, 0.15).sum()) == math.ceil(0.15 * 60)
    # all of it: every block that changed at all; never the zero-deviation one (KV cached in this
    # very context)
    everything = probe_blocks(spans, 64, 16, positions, deviation, 1.0)
    assert everything.nonzero().squeeze(1).tolist() == list(range(0, 56))


def test_probe_sample_takes_the_middle_of_every_block_short_ones_too():
    sample = probe_sample([(2, 40), (40, 43)], 50, 16)
    assert sample.nonzero().squeeze(1).tolist() == [10, 26, 37, 41]  # [2,18) [18,34) [34,40) | [40,43)


def test_probe_layer_defaults_to_a_quarter_of_the_depth_and_is_validated():
    assert EngineConfig().resolved_probe_layer(30) == 8
    assert EngineConfig().resolved_probe_layer(2) == 1
    assert EngineConfig(probe_layer=50).resolved_probe_layer(6) == 5
    with pytest.raises(InvalidRequestError, match="probe_layer"):
        EngineConfig(probe_layer=0)
    with pytest.raises(InvalidRequestError, match="probe_stride"):
        EngineConfig(probe_stride=0)


def test_probe_recomputes_the_blocks_it_measured_most_changed(tiny_engine, monkeypatch):
    chunks = make_docs(4, seed=3)
    tiny_engine.warm(chunks)
    seen = []
    original = probe_module.probe_blocks

    def spy(spans, n, stride, positions, deviation, ratio):
        chosen = original(spans, n, stride, positions, deviation, ratio)
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
    probe_layer = tiny_engine.config.resolved_probe_layer(layers)
    uncached = g.stats.prompt_tokens - g.stats.cached_tokens
    assert round(g.stats.compute_fraction * g.stats.prompt_tokens * layers) == (
        (uncached + int(chosen.sum())) * layers + positions.numel() * probe_layer
    )
