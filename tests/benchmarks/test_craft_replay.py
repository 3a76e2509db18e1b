"""The model-free CRAFT replay and the method specs' ``+order=``."""

from __future__ import annotations

import pytest

from benchmarks.craft_replay import replay
from benchmarks.methods import parse_methods
from kvrag.errors import InvalidRequestError


def test_replay_counts_prefix_and_total_hits_per_order():
    # CRAFT's §3.1 example (R1, R2), then sets that share chunks in other orders
    stream = [[1, 4, 5, 6, 7], [1, 2, 3, 4, 5], [5, 4, 9, 8, 1], [4, 5, 1, 10, 11]]
    plain = replay(stream, window=None, order="retrieval", tau=2)
    assert plain["prefix"] == pytest.approx((1 + 0 + 0) / 5 / 3)
    assert plain["total"] == pytest.approx((3 + 3 + 3) / 5 / 3)
    freq = replay(stream, window=None, order="frequency", tau=2)
    assert freq["total"] == plain["total"]  # order never changes what is shared
    assert freq["prefix"] > plain["prefix"]  # popular chunks line up: 1, 4, 5 lead the later requests
    assert freq["tree_nodes_tau2"] < freq["tree_nodes_tau1"]  # promotion keeps what recurs only


def test_method_specs_take_a_chunk_order():
    full, ordered, prefix = parse_methods("full,full+order=frequency,prefix+order=retrieval")
    assert (full.order, ordered.order, prefix.order) == (None, "frequency", "retrieval")
    assert ordered.overrides == {} and ordered.mode == "full"
    with pytest.raises(InvalidRequestError, match="unknown chunk order 'hot'"):
        parse_methods("blend+order=hot")
