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
    counts = replay(stream, window=None, order="counts", tau=2)
    assert counts["total"] == plain["total"]  # order never changes what is shared
    assert counts["prefix"] > plain["prefix"]  # popular chunks line up: 1, 4, 5 lead the later requests
    assert counts["tree_nodes_tau2"] < counts["tree_nodes_tau1"]  # promotion keeps what recurs only
    for order in ("frequency", "frequency-promoted", "hysteresis", "path-first"):
        assert replay(stream, window=None, order=order, tau=2)["total"] == plain["total"]
    with pytest.raises(ValueError, match="unknown order"):
        replay(stream, window=None, order="best")


def test_the_engines_frequency_order_follows_a_stored_sequence_that_counts_would_reshuffle():
    # a question asked, then asked again reworded (same chunks, another retrieval order), while a
    # popular chunk (9) drifts past the question's: counts alone reshuffle the returning question
    stream = [[1, 2, 3], [9, 4, 5], [9, 6, 7], [3, 1, 2], [9, 8, 3], [2, 3, 1]]
    counts = replay(stream, window=None, order="counts", tau=1)
    tree = replay(stream, window=None, order="frequency", tau=1)
    assert tree["prefix"] > counts["prefix"]


def test_method_specs_take_a_chunk_order():
    full, ordered, prefix = parse_methods("full,full+order=frequency,prefix+order=retrieval")
    assert (full.order, ordered.order, prefix.order) == (None, "frequency", "retrieval")
    assert ordered.overrides == {} and ordered.mode == "full"
    with pytest.raises(InvalidRequestError, match="unknown chunk order 'hot'"):
        parse_methods("blend+order=hot")


def test_replay_splits_tree_hits_by_kind_of_ask():
    # question A asked, a filler, A back (first return), A back again (a later return)
    stream = [[1, 2, 3], [7, 8, 9], [1, 2, 3], [1, 2, 3]]
    occurrences = [0, 0, 1, 2]
    promoted = replay(stream, window=None, order="retrieval", tau=2, occurrences=occurrences)
    assert promoted["asks"] == {"first asks": 2, "first returns": 1, "later returns": 1}
    # tau = 2: the first return promotes the sequence, so only the later return finds it whole
    assert promoted["tree_tau2_by_ask"] == {"first asks": 0.0, "first returns": 0.0, "later returns": 1.0}
    # every sequence kept (tau = 1): the first return finds it already
    assert promoted["tree_tau1_by_ask"] == {"first asks": 0.0, "first returns": 1.0, "later returns": 1.0}
    assert "asks" not in replay(stream, window=None, order="retrieval", tau=2)
