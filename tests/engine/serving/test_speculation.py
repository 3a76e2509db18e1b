"""RAGCache's speculative pipelining: chunk-level and prompt-level speculation on the engine thread."""

from __future__ import annotations

import threading
import time

import pytest

from kvrag import Engine, InvalidRequestError, SamplingParams
from kvrag.engine.serving.scheduler import Ticket
from tests.helpers import PREFIX, SUFFIX, hold_engine_thread, make_docs


@pytest.fixture
def engine(tiny_model, tiny_tokenizer, one_thread):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=6))
    yield engine
    engine.close()


@pytest.fixture
def reference(tiny_model, tiny_tokenizer):
    """An engine of the same model that never speculates."""
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=6))
    yield engine
    engine.close()


def keys_of(engine, texts):
    return [engine.planner.chunk_key(engine.prompt_tokenizer.tokenize(t), engine.config.namespace) for t in texts]


# -- chunk-level ---------------------------------------------------------------------------------------


def test_chunk_speculation_stores_missing_chunks_as_speculative_entries_without_counting_hits(engine):
    docs = make_docs(3, seed=61)
    engine.warm(docs[:1])
    hits = engine.store.stats()["hits"]
    spec = engine.speculate(docs, key="q")
    assert spec.wait(30) and spec.state == "done" and spec.result == 2
    assert spec.tokens == sum(engine.count_tokens(d) for d in docs[1:])
    stored = keys_of(engine, docs)
    assert all(engine.store.contains(k) for k in stored)
    assert set(engine.store._speculative) == set(stored[1:])  # only free room; the warmed one is not speculative
    assert engine.store.stats()["hits"] == hits
    gen = engine.generate(docs, PREFIX, SUFFIX)
    assert gen.stats.chunk_hits == 3
    again = engine.speculate(docs, key="q")  # nothing missing: done at once, nothing queued
    assert again.state == "done" and again.result == 0 and again.finished


def test_a_changed_list_cancels_the_speculation_of_the_same_key(engine):
    docs = make_docs(4, seed=62)
    gate = hold_engine_thread(engine)
    first = engine.speculate(docs[:2], key="q")
    other = engine.speculate(docs[3:], key="another request")
    second = engine.speculate(docs[1:3], key="q")
    assert first.state == "cancelled" and first.finished
    gate.set()
    assert second.wait(30) and other.wait(30)
    assert (second.state, other.state) == ("done", "done")
    held = [engine.store.contains(k) for k in keys_of(engine, docs)]
    assert held == [False, True, True, True]  # docs[0] dropped out before its work started
    assert engine.speculations.counts["cancelled"] == 1 and not engine.speculations.live()


def test_speculative_work_gives_way_to_a_request_at_its_next_pause(engine):
    """A speculation running when foreground work arrives stops at its next pause (stopped), and the
    foreground job runs."""
    started, seen = threading.Event(), []

    def job(handle, pause):
        started.set()
        for _ in range(2000):
            pause()
            time.sleep(0.001)
        return "finished"

    spec = engine.speculations.start("prompt", "k", 100, job)
    assert started.wait(10)
    engine._run_internal(lambda pause: seen.append("foreground"), 1)
    assert spec.wait(10) and spec.state == "stopped" and seen == ["foreground"]
    counts = engine.speculations.counts
    assert counts["stopped"] == 1 and counts["wasted_tokens"] == spec.computed > 0


def test_a_cancelled_speculation_stops_at_its_next_pause(engine):
    started = threading.Event()

    def job(handle, pause):
        started.set()
        while True:
            pause()
            time.sleep(0.001)

    spec = engine.speculations.start("chunks", "k", 10, job)
    assert started.wait(10)
    spec.cancel()
    assert spec.wait(10) and spec.state == "cancelled"
    static = engine.speculations.start("chunks", "k2", 10, job, dynamic=False)  # ordinary work: cancelled too
    time.sleep(0.05)
    static.cancel()
    assert static.wait(10)


def test_at_most_max_live_speculations_are_held(engine, monkeypatch):
    from kvrag.engine.serving import speculation

    monkeypatch.setattr(speculation, "MAX_LIVE", 2)
    gate = hold_engine_thread(engine)
    handles = [engine.speculations.start("prompt", i, 1, lambda h, p: None) for i in range(3)]
    assert [h.state for h in handles] == ["cancelled", "waiting", "waiting"]
    gate.set()
    assert all(h.wait(10) for h in handles[1:])


# -- prompt-level ----------------------------------------------------------------------------------------


def test_an_identical_request_adopts_the_speculation_with_the_same_output(engine, reference):
    docs = make_docs(3, seed=63)
    hits = engine.store.stats()["hits"]
    spec = engine.speculate_request(docs, PREFIX, SUFFIX, key="q")
    assert spec.wait(30) and spec.state == "done"
    assert engine.store.stats()["hits"] == hits and not engine.store.stats()["puts"]  # nothing kept yet
    stream = engine.stream(docs, PREFIX, SUFFIX)
    pieces = list(stream)
    gen = stream.generation
    assert spec.state == "adopted" and engine.speculations.counts["adopted"] == 1
    ref_stream = reference.stream(docs, PREFIX, SUFFIX)
    assert pieces == list(ref_stream)
    assert gen.token_ids == ref_stream.generation.token_ids and gen.text == ref_stream.generation.text
    assert gen.ttft_s < 0.5 * ref_stream.generation.ttft_s or gen.ttft_s < 0.01
    engine.flush()
    assert engine.generate(docs, PREFIX, SUFFIX).stats.chunk_hits == 3  # adopted: its write-back ran
    assert engine.speculations.counts["wasted_tokens"] == 0


def test_a_speculation_that_loses_changes_no_answer(engine, reference):
    """Every request's output equals the non-speculative engine's, whether its speculation won
    (adopted), lost (the list changed: afresh) or was still waiting."""
    docs = make_docs(6, seed=64)
    cases = [
        (docs[:3], docs[:3]),  # won
        (docs[1:4], docs[2:5]),  # lost: the list changed
        (docs[3:6], docs[3:6]),  # won, with some chunks cached by now
        (docs[:2], docs[:3]),  # lost
    ]
    for speculated, final in cases:
        spec = engine.speculate_request(speculated, PREFIX, SUFFIX, key="q")
        spec.wait(30)
        gen = engine.generate(final, PREFIX, SUFFIX)
        if speculated != final:
            assert spec.state == "done"  # not adopted: held until cancelled
            spec.cancel()
            assert spec.state == "cancelled"
        else:
            assert spec.state == "adopted"
        ref = reference.generate(final, PREFIX, SUFFIX)
        assert gen.token_ids == ref.token_ids, (speculated == final, gen.text, ref.text)
        engine.flush()
        reference.flush()
    counts = engine.speculations.counts
    assert counts["adopted"] == 2 and counts["wasted_tokens"] > 0
    assert engine.store.stats()["hits"] == reference.store.stats()["hits"]


def test_other_sampling_or_mode_does_not_adopt(engine):
    docs = make_docs(2, seed=65)
    spec = engine.speculate_request(docs, PREFIX, SUFFIX)
    spec.wait(30)
    engine.generate(docs, PREFIX, SUFFIX, max_new_tokens=3)
    engine.generate(docs, PREFIX, SUFFIX, mode="full")
    assert spec.state == "done"
    engine.generate(docs, PREFIX, SUFFIX)
    assert spec.state == "adopted"


def test_a_request_arriving_while_its_speculation_waits_runs_afresh(engine, reference):
    docs = make_docs(2, seed=66)
    gate = hold_engine_thread(engine)
    spec = engine.speculate_request(docs, PREFIX, SUFFIX, key="q")
    stream = engine.stream(docs, PREFIX, SUFFIX)
    assert spec.state == "cancelled"
    gate.set()
    list(stream)
    assert stream.generation.token_ids == reference.generate(docs, PREFIX, SUFFIX).token_ids


def test_adopting_a_running_speculation_promotes_it(engine):
    """Adopted mid-prefill, the speculation no longer gives way: the request waiting for it does not stop it."""
    release, started = threading.Event(), threading.Event()

    def job(handle, pause):
        started.set()
        while not release.is_set():
            pause()
            time.sleep(0.001)
        return "held"

    spec = engine.speculations.start("prompt", "k", 10, job, signature=("sig",))
    assert started.wait(10)
    assert engine.speculations.adopt(("sig",)) is spec
    assert engine.speculations.adopt(("sig",)) is None  # no second taker
    done = threading.Event()
    threading.Thread(target=lambda: (engine._run_internal(lambda p: None, 1), done.set()), daemon=True).start()
    time.sleep(0.05)
    assert not spec.finished  # foreground work waits; the promoted speculation goes on
    release.set()
    assert spec.wait(10) and spec.state == "done" and done.wait(10)
    assert engine.speculations.take(spec) == "held" and spec.state == "adopted"


def test_bad_speculations_are_refused(engine):
    with pytest.raises(InvalidRequestError, match="conversation"):
        engine.speculate_request(make_docs(1), PREFIX, SUFFIX, conversation_id="c1")
    with pytest.raises(InvalidRequestError):
        engine.speculate("not a list")
    with pytest.raises(InvalidRequestError):
        engine.speculate_request(make_docs(1), PREFIX, SUFFIX, mode="nonsense")


def test_close_cancels_live_speculations(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=4))
    spec = engine.speculate_request(make_docs(2, seed=67), PREFIX, SUFFIX)
    spec.wait(30)
    engine.close()
    assert spec.state == "cancelled" and spec.result is None


def test_speculative_tickets_are_marked():
    assert not Ticket(tokens=1, speculative=True).foreground
