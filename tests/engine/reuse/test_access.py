"""CRAFT's chunk-access table: the sliding window, frequency order, promotion, tenants."""

from __future__ import annotations

import random
import threading

import pytest

from kvrag import Engine, InvalidRequestError, SamplingParams
from kvrag.engine.reuse.access import AccessTable, chunk_key, frequency_order, stored_path_order
from tests.helpers import PREFIX, SUFFIX, make_docs


def zipf_stream(n_items: int, n_requests: int, k: int, seed: int = 0) -> list[list[str]]:
    """Retrievals of ``k`` distinct chunk names each, Zipf(1) popularity over ``n_items``."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) for r in range(n_items)]
    out = []
    for _ in range(n_requests):
        picked: dict[str, None] = {}
        while len(picked) < k:
            picked[f"chunk {rng.choices(range(n_items), weights)[0]}"] = None
        out.append(list(picked))
    return out


def test_counts_cover_the_last_w_retrievals_of_a_500_request_zipf_stream():
    stream = zipf_stream(60, 500, 6, seed=1)
    for window in (16, 64, None):
        table = AccessTable(window)
        for docs in stream:
            table.record("t", docs)
        recent = stream if window is None else stream[-window:]
        every = sorted({d for docs in stream for d in docs})
        want = [sum(d in docs for docs in recent) for d in every]
        assert table.counts("t", every) == want, window
        stats = table.stats("t")
        assert stats.retrievals == len(recent) and stats.recorded == 500
        assert stats.chunks == sum(c > 0 for c in want)  # a chunk that left the window takes no room
        assert stats.promoted == sum(c >= 2 for c in want)
        assert stats.top[0][1] == max(want)


def test_a_chunk_leaves_the_window_and_counts_once_per_retrieval():
    table = AccessTable(window=2)
    table.record("t", ["a", "b", "a"])  # twice in one retrieval: one access
    assert table.counts("t", ["a", "b"]) == [1, 1]
    table.record("t", ["a"])
    table.record("t", ["c"])  # the first retrieval leaves the window
    assert table.counts("t", ["a", "b", "c"]) == [1, 0, 1]
    # whitespace at the ends is not part of a chunk's identity (frameworks strip what they stuff)
    assert table.counts("t", ["  c\n"]) == [1] and chunk_key(" c ") == chunk_key("c")


def test_a_document_in_several_forms_is_one_access_found_by_any_form():
    table = AccessTable()
    table.record("t", [("title: x\n\nbody", "body"), "other"])
    assert table.counts("t", ["body", "title: x\n\nbody", ("body", "unseen"), "other"]) == [1, 1, 1, 1]


def by_key(texts: list[str]) -> list[str]:
    return sorted(texts, key=chunk_key)


def test_frequency_order_is_descending_with_ties_in_retrieval_order_unless_a_stored_path_leads():
    assert frequency_order([1, 3, 0, 3, 1]) == [1, 3, 0, 4, 2]  # no keys: ties in retrieval order
    assert frequency_order([1, 3, 0, 3, 1], ["e", "d", "a", "b", "c"]) == [3, 1, 4, 0, 2]
    table = AccessTable()
    for docs in (["b", "c"], ["c"], ["d", "c"]):
        table.record("t", docs)
    docs = ["a", "b", "c", "d"]
    got = [docs[i] for i in table.order("t", docs, "frequency")]
    assert got == ["c", "b", "d", "a"]  # b and d tied, never computed: in retrieval order (stable)
    back = docs[::-1]
    assert [back[i] for i in table.order("t", back, "frequency")] == ["c", "d", "b", "a"]
    table.computed("t", ["d", "b"])  # computed, nothing stored: ties still keep retrieval order
    assert [docs[i] for i in table.order("t", docs, "frequency")] == ["c", "b", "d", "a"]
    table.stored("t", ["c"])  # behind a stored path, tied chunks go in the order their KV was computed
    assert [x[i] for x in (docs, back) for i in table.order("t", x, "frequency")] == ["c", "d", "b", "a"] * 2
    assert table.order("t", docs, "retrieval") == [0, 1, 2, 3]


def test_stored_path_order_puts_the_longest_stored_path_first_then_counts():
    stored = {("x",), ("x", "y"), ("x", "y", "z"), ("q",), ("q", "w")}
    keys = [("a",), ("z",), ("y",), ("x",), ("w",)]
    # x, y, z (a stored path: 3 long) leads though a is the most retrieved; then a, w by count
    assert stored_path_order(keys, [9, 0, 1, 1, 2], stored.__contains__) == [3, 2, 1, 0, 4]
    # prefix slicing: only x, y of the stored x, y, z is retrieved: it leads
    assert stored_path_order([("y",), ("a",), ("x",)], [0, 5, 0], stored.__contains__) == [2, 0, 1]
    # a document in several forms continues a path by any of them
    assert stored_path_order([("b",), ("q2", "q")], [3, 0], stored.__contains__) == [1, 0]
    # nothing stored: the count order, ties by content key
    assert stored_path_order([("b",), ("a",), ("c",)], [1, 1, 2], lambda p: False) == [2, 1, 0]


def test_stored_paths_lead_the_frequency_order_per_tenant_and_are_bounded():
    table = AccessTable(window=16, max_paths=4)
    for _ in range(3):
        table.record("t", ["hot", "warm"])
    table.stored("t", ["cold", "warm"])  # kept exactly: cold, then warm
    docs = ["warm", "hot", "cold"]
    assert [docs[i] for i in table.order("t", docs, "frequency")] == ["cold", "warm", "hot"]
    assert [docs[i] for i in table.order("u", docs, "frequency")] == docs  # another tenant: retrieval order
    assert table.stats("t").stored_paths == 2 and table.stats("u").stored_paths == 0
    table.stored("t", ["a", "b", "c"])  # 5 paths > 4: the least recently used goes, a leaf first
    paths = table.stored_paths("t")
    assert len(paths) == 4 and (chunk_key("cold"),) in paths
    assert all(p[:-1] in paths for p in paths if len(p) > 1)  # leading parts kept with their paths
    assert (chunk_key("cold"), chunk_key("warm")) not in paths
    table.clear()
    assert table.stored_paths("t") == []
    with pytest.raises(ValueError, match="max_paths"):
        AccessTable(max_paths=-1)


def test_an_unknown_order_is_one_clear_error_naming_the_orders():
    with pytest.raises(ValueError, match="unknown chunk order 'popular'; use one of 'retrieval', 'frequency'"):
        AccessTable().order("t", ["a"], "popular")
    with pytest.raises(ValueError, match="window"):
        AccessTable(window=0)
    with pytest.raises(ValueError, match="threshold"):
        AccessTable(threshold=0)


def test_tenants_never_see_each_others_counts():
    table = AccessTable()
    for _ in range(3):
        table.record("alice", ["shared", "hers"])
    table.record("bob", ["his"])
    assert table.counts("bob", ["shared", "hers", "his"]) == [0, 0, 1]
    assert table.order("bob", ["shared", "his"], "frequency") == [1, 0]
    table.stored("alice", ["shared"])
    assert table.order("bob", ["his", "other"], "frequency") == [0, 1]  # her stored path is not his
    assert table.promoted("bob", ["shared", "his"]) == 0
    assert table.promoted("alice", ["shared", "hers", "his"]) == 2


def test_promotion_is_the_leading_run_of_chunks_at_the_threshold():
    table = AccessTable(threshold=2)
    assert table.promoted("t", ["a", "b"]) == 2  # nothing ever counted here: nothing to gate on
    table.record("t", ["a", "b", "e"])
    assert table.promoted("t", ["a", "b", "e"]) == 0
    table.record("t", ["a", "b", "f"])  # CRAFT's example: a and b reach 2, so [a, b] is promoted
    assert table.promoted("t", ["a", "b", "f"]) == 2
    assert table.promoted("t", ["e", "a", "b"]) == 0  # a run starts at the first chunk
    table.record("t", ["a", "b", "f"])  # f reaches 2: the kept prefix grows by it
    assert table.promoted("t", ["a", "b", "f"]) == 3


def test_the_table_counts_from_many_threads_at_once():
    table = AccessTable(window=None)
    threads = [threading.Thread(target=lambda: [table.record("t", ["x", "y"]) for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert table.counts("t", ["x", "y"]) == [800, 800]


# -- in the engine (tiny random model) -------------------------------------------------------------


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2))
    yield engine
    engine.close()


def sources(gen) -> list[str]:
    return [c.source for c in gen.stats.chunks]


def test_a_sequence_kept_exactly_leads_the_frequency_order_and_is_reused_whole(engine):
    docs = make_docs(3, seed=66)
    given = [docs[2], docs[0], docs[1]]
    engine.generate(given, PREFIX, SUFFIX, mode="prefix")  # prefix mode keeps the whole exact prompt
    engine.writeback.flush()
    assert engine.access.stored_paths("default")[-1] == (chunk_key(docs[2]),)  # leading parts used last
    assert tuple(chunk_key(d) for d in given) in engine.access.stored_paths("default")
    engine.record_retrieval([docs[1]])  # docs[1] is now the most retrieved: counts alone would lead with it
    again = engine.generate(docs, PREFIX, SUFFIX, mode="prefix", chunk_order="frequency")
    assert sources(again) == ["prefix"] * 3  # the stored sequence's order: reused whole
    assert [c.tokens for c in again.stats.chunks] == [engine.count_tokens(d) for d in given]


def test_a_sequence_is_refreshed_exactly_only_once_its_chunks_reach_tau(engine):
    """Blended once (each chunk retrieved once) the sequence is not refreshed; asked again (each
    chunk at tau = 2) it is, and a third ask reuses it exactly."""
    docs = make_docs(3, seed=61)
    engine.warm(docs[::-1])  # each chunk's KV computed behind other documents: blended in this order
    counts = engine.writeback.refresh_counts
    assert sources(engine.generate(docs, PREFIX, SUFFIX)) == ["store"] * 3
    engine.flush()
    assert (counts["runs"], counts["unpromoted"]) == (0, 3)
    assert sources(engine.generate(docs, PREFIX, "again: " + SUFFIX)) == ["store"] * 3
    engine.flush()
    assert (counts["runs"], counts["chunks"]) == (1, 3)
    assert sources(engine.generate(docs, PREFIX, "a third time: " + SUFFIX)) == ["tree"] * 3
    assert engine.chunk_access().promoted == 3


def test_only_the_leading_run_of_recurring_chunks_is_refreshed(engine):
    docs = make_docs(4, seed=62)
    engine.warm(docs[::-1])
    engine.record_retrieval(docs[:2])  # docs 0 and 1 retrieved before: at tau after the request
    engine.generate([docs[0], docs[1], docs[2], docs[3]], PREFIX, SUFFIX)
    engine.flush()
    counts = engine.writeback.refresh_counts
    assert (counts["runs"], counts["chunks"], counts["unpromoted"]) == (1, 2, 2)
    got = engine.generate([docs[0], docs[1], docs[3], docs[2]], PREFIX, SUFFIX)
    assert sources(got) == ["tree", "tree", "store", "store"]  # the promoted prefix, sliced off the path


def test_generate_orders_chunks_by_frequency_only_when_asked(engine):
    docs = make_docs(4, seed=63)
    for _ in range(2):
        engine.record_retrieval([docs[3], docs[2]])
    plain = engine.generate(docs, PREFIX, SUFFIX, mode="full")
    assert [c.tokens for c in plain.stats.chunks] == [engine.count_tokens(d) for d in docs]  # given order
    # docs 3 and 2 lead, then 0 and 1 (full prefills store no exact path; ties never computed: retrieval order)
    ordered = [docs[2], docs[3], docs[0], docs[1]]
    want = engine.generate(ordered, PREFIX, SUFFIX, mode="full")
    got = engine.generate(docs, PREFIX, SUFFIX, mode="full", chunk_order="frequency")
    assert got.token_ids == want.token_ids and got.stats.prompt_tokens == want.stats.prompt_tokens
    assert engine.access.counts("default", docs) == [3, 3, 5, 5]  # each generate counted once
    scored = engine.score("x", docs, PREFIX, SUFFIX, mode="full", chunk_order="frequency")
    assert scored.logprob == pytest.approx(engine.score("x", ordered, PREFIX, SUFFIX, mode="full").logprob)
    assert engine.access.counts("default", docs) == [3, 3, 5, 5]  # scoring counts no retrieval
    with pytest.raises(InvalidRequestError, match="unknown chunk order 'best'; use one of 'retrieval', 'frequency'"):
        engine.generate(docs, PREFIX, SUFFIX, chunk_order="best")
    with pytest.raises(InvalidRequestError, match="chunk_order orders chunks="):
        engine.generate(prompt=PREFIX + docs[0] + SUFFIX, chunk_order="frequency")
    assert engine.access.counts("default", docs) == [3, 3, 5, 5]  # refused requests count nothing


def test_a_later_turn_of_a_conversation_keeps_retrieval_order(engine):
    docs = make_docs(3, seed=64)
    for _ in range(3):
        engine.record_retrieval([docs[2]])
    first = engine.generate(docs[:2], PREFIX, SUFFIX, conversation_id="c", chunk_order="frequency")
    assert first.stats.chunk_misses == 2
    asked = []
    real = engine.requests.build

    def spy(chunks, *args):
        asked.append(list(chunks))
        return real(chunks, *args)

    engine.requests.build = spy
    engine.generate(docs, "", SUFFIX, conversation_id="c", chunk_order="frequency", dedup=False)
    # what the table says now (counts: docs[2] most retrieved; paths the turns of "c" kept exactly)
    want = [docs[i] for i in engine.access.order("default", docs, "frequency")]
    engine.generate(docs, "", SUFFIX, conversation_id="other", chunk_order="frequency")
    assert asked == [docs, want]  # a later turn keeps the given order; a first turn is reordered


def test_record_retrieval_counts_per_tenant_and_checks_its_input(engine):
    docs = make_docs(2, seed=65)
    assert engine.record_retrieval(docs, namespace="a") == [0, 1]
    # tied counts, never computed: retrieval order
    assert engine.record_retrieval(docs[::-1], order="frequency", namespace="a") == [0, 1]
    assert engine.record_retrieval([docs[0], docs[1]], order="frequency", namespace="a") == [0, 1]
    engine.record_retrieval([docs[1]], namespace="b")
    assert engine.record_retrieval(docs, order="frequency", namespace="b") == [1, 0]
    assert engine.chunk_access("a").retrievals == 3 and engine.chunk_access("b").retrievals == 2
    assert engine.chunk_access().retrievals == 0 and engine.chunk_access().window == 1000
    with pytest.raises(InvalidRequestError, match="single string"):
        engine.record_retrieval("one text")
    with pytest.raises(InvalidRequestError, match="unknown chunk order"):
        engine.record_retrieval(docs, order="lru")


def test_config_checks_the_window_and_the_threshold(tiny_model, tiny_tokenizer):
    with pytest.raises(InvalidRequestError, match="chunk_access_window"):
        Engine.from_model(tiny_model, tiny_tokenizer, chunk_access_window=0)
    with pytest.raises(InvalidRequestError, match="promotion_threshold"):
        Engine.from_model(tiny_model, tiny_tokenizer, promotion_threshold=0)
    with Engine.from_model(tiny_model, tiny_tokenizer, chunk_access_window=None) as engine:
        assert engine.chunk_access().window is None


def test_tied_chunks_behind_a_stored_path_go_in_the_order_their_kv_was_first_computed():
    table = AccessTable()
    for docs in (["b", "c"], ["c"]):
        table.record("t", docs)
    table.computed("t", ["d", "b", "a"])  # a warm's stream: d, then b, then a
    table.computed("t", ["a", "e"])  # a keeps its first number; e comes after
    assert table.computation_order("t") == [chunk_key(x) for x in ("d", "b", "a", "e")]
    docs = ["a", "b", "c", "d", "e", "f"]
    # no stored path leads: c (2), then b (1), then the count-0 chunks in retrieval order (a warmed
    # corpus computed every chunk in its own stream: following it reorders a first ask for nothing)
    assert [docs[i] for i in table.order("t", docs, "frequency")] == ["c", "b", "a", "d", "e", "f"]
    table.stored("t", ["e"])  # a stored path leads; behind it the count-0 chunks in computation order
    assert [docs[i] for i in table.order("t", docs, "frequency")] == ["e", "c", "b", "d", "a", "f"]
    assert table.order("u", docs[::-1], "frequency") == list(range(6))  # tenants apart: nothing known there
    small = AccessTable(max_computed=2)
    small.computed("t", ["x", "y", "z"])
    assert small.computation_order("t") == [chunk_key("y"), chunk_key("z")]  # the earliest forgotten
    with pytest.raises(ValueError, match="max_computed"):
        AccessTable(max_computed=-1)


def test_a_warm_stream_does_not_reorder_a_first_ask(engine):
    docs = make_docs(4, seed=67)
    engine.warm([docs[2], docs[0], docs[3], docs[1]])
    engine.flush()
    assert engine.access.computation_order(engine.config.namespace) == [chunk_key(docs[i]) for i in (2, 0, 3, 1)]
    assert engine.record_retrieval(docs, order="frequency") == [0, 1, 2, 3]  # tied, none stored: retrieval order
    got = engine.generate(docs, PREFIX, SUFFIX, chunk_order="frequency")
    assert [c.tokens for c in got.stats.chunks] == [engine.count_tokens(d) for d in docs]
    assert sources(got) == ["store"] * 4
