"""Which cached tokens blend recomputes: the probe's budget and passes, on the tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch

import kvrag.engine.reuse.selection.probe as probe_module
from kvrag import InvalidRequestError
from kvrag.config import EngineConfig
from kvrag.engine.reuse.selection import ProbeParams, configured_params, probe_blocks, probe_sample
from tests.helpers import PREFIX, SUFFIX, make_docs, placed_again


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


@pytest.mark.parametrize("selection", ["probe", "recency"])
def test_a_layer_placed_again_puts_back_only_what_a_pass_computed_over(tiny_engine, monkeypatch, selection):
    """The probe's passes run the first layers twice; the second placement restores the positions the
    first pass computed over instead of placing the layer whole: the same logits, bit for bit."""
    restored, fast, whole = placed_again(tiny_engine, monkeypatch, selection)
    assert restored or selection == "recency"  # recency runs each layer once
    assert torch.equal(whole, fast)
