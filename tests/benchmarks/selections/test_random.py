"""``selection="random"``: the benchmarks' ablation, the probe's blocks in a random order."""

from __future__ import annotations

import pytest
import torch

import benchmarks.selections.random as random_module
import kvrag.engine.reuse.selection.probe as probe_module
from benchmarks.selections import random_order
from kvrag import Engine
from kvrag.engine.reuse.selection import ProbeParams, params_class, registered_selections
from tests.helpers import PREFIX, SUFFIX, make_docs


def test_random_is_registered_by_the_benchmarks_with_the_probes_parameters():
    assert "random" in registered_selections() and params_class("random") is ProbeParams


def test_random_spends_the_probes_budget_on_other_blocks_the_same_each_time(tiny_model, tiny_tokenizer, monkeypatch):
    """The ablation: the probe's passes and budget, blocks in a random order seeded by the prompt."""
    chunks = make_docs(4, seed=6)
    engine = Engine.from_model(tiny_model, tiny_tokenizer, tree_refresh=False, prefix_cache=False)
    engine.warm(chunks)
    order = [chunks[i] for i in (2, 0, 3, 1)]
    chosen = {}
    real = probe_module.probe_blocks

    def spy(name):
        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            chosen.setdefault(name, []).append(out.nonzero().squeeze(1).tolist())
            return out

        return wrapped

    runs = {}
    for name, module in (("probe", probe_module), ("random", random_module), ("random", random_module)):
        monkeypatch.setattr(module, "probe_blocks", spy(name))
        runs.setdefault(name, []).append(
            engine.generate(order, PREFIX, SUFFIX, selection=name, recompute_ratio=0.3, max_new_tokens=1)
        )
    engine.close()
    (p,), (r1, r2) = runs["probe"], runs["random"]
    assert p.stats.recomputed_tokens == r1.stats.recomputed_tokens == r2.stats.recomputed_tokens > 0
    assert p.stats.compute_fraction == pytest.approx(r1.stats.compute_fraction)  # the same passes
    assert chosen["random"][0] == chosen["random"][1] != chosen["probe"][0]
    dev = torch.tensor([0.0, 2.0, 1.0, 3.0])
    ids = torch.arange(10)
    scores = random_order(dev, ids)
    assert scores[0] == 0 and (scores[1:] > 0).all() and torch.equal(scores, random_order(dev, ids))
