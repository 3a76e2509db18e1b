"""The knowledge tree's refresh: a blended chunk sequence computed exactly in idle engine time."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvrag import Engine, InvalidRequestError, SamplingParams
from kvrag.engine.serving.scheduler import Ticket
from kvrag.engine.serving.worker import Preempted
from kvrag.engine.serving.writeback import MAX_REFRESHES
from tests.helpers import PREFIX, SUFFIX, hold_engine_thread, last_logits, make_docs

#: The refresh's own mechanics: every retrieved sequence is promoted (tau = 1). CRAFT's default,
#: tau = 2, is tests/engine/reuse/test_access.py's.
EVERY_SEQUENCE = {"promotion_threshold": 1}


def sources(gen) -> list[str]:
    return [c.source for c in gen.stats.chunks]


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=6), **EVERY_SEQUENCE)
    yield engine
    engine.close()


def test_a_blended_sequence_comes_back_exact_with_the_full_prefills_output(engine):
    """Chunks warmed in other company are blended once; the refresh leaves their sequence exact, so
    the same chunks asked again (another question) reuse it exactly: nothing recomputed, and the
    same tokens and logits as a full prefill of that prompt."""
    docs = make_docs(3, seed=41)
    engine.warm(docs[::-1])  # each chunk's KV computed behind other documents
    first = engine.generate(docs, PREFIX, SUFFIX)
    assert sources(first) == ["store"] * 3
    engine.flush()
    counts = engine.writeback.refresh_counts
    assert (counts["runs"], counts["chunks"], counts["preempted"]) == (1, 3, 0) and counts["seconds"] > 0
    reworded = "tell me, " + SUFFIX
    again = engine.generate(docs, PREFIX, reworded)
    assert sources(again) == ["tree"] * 3
    assert again.stats.recomputed_tokens == 0 and again.stats.exact_tokens == again.stats.cached_tokens
    full = engine.generate(docs, PREFIX, reworded, mode="full")
    assert again.token_ids == full.token_ids
    torch.testing.assert_close(last_logits(engine, docs, "blend"), last_logits(engine, docs, "full"))
    engine.flush()
    assert engine.writeback.refresh_counts["runs"] == 1  # nothing blended: nothing to refresh


def test_a_refresh_reads_the_store_without_counting_uses(engine):
    """The refresh's lookups (the exact prefix, exact variants) are looks, not uses: the store's
    hit and miss counters stay where the request left them, and the refreshed variants it keeps
    speculative stay "not used yet" until a request reuses them."""
    docs = make_docs(3, seed=45)
    engine.generate(docs[:1], PREFIX, SUFFIX)  # the lead and docs[0] kept exact: the refresh reuses them
    engine.flush()
    engine.warm(docs[1:][::-1])
    engine.generate(docs, PREFIX, SUFFIX)
    before = engine.store.stats()
    engine.flush()
    after = engine.store.stats()
    assert engine.writeback.refresh_counts["chunks"] == 2
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    assert len(engine.store._speculative) == 2
    assert sources(engine.generate(docs, PREFIX, "tell me, " + SUFFIX)) == ["tree"] * 3
    assert not engine.store._speculative  # used now


def test_only_the_chunks_after_the_exact_part_are_refreshed(engine):
    """A prompt whose first chunks are already exact (a stored path) refreshes the rest only, reusing
    the exact KV before it; chunks in another order later find the exact path as far as it goes."""
    docs = make_docs(4, seed=42)
    engine.generate(docs[:2], PREFIX, SUFFIX)  # cold: computed here, kept exact
    engine.flush()
    engine.warm(docs[2:])
    mixed = engine.generate(docs, PREFIX, SUFFIX)
    assert sources(mixed) == ["tree", "tree", "store", "store"]
    engine.flush()
    assert engine.writeback.refresh_counts["chunks"] == 2
    assert sources(engine.generate(docs, PREFIX, SUFFIX)) == ["tree"] * 4
    assert sources(engine.generate(docs[:3] + [docs[1]], PREFIX, SUFFIX))[:3] == ["tree"] * 3


def test_chunks_at_the_variant_cap_are_not_refreshed(tiny_model, tiny_tokenizer):
    """A refreshed variant never pushes out another, so chunks holding ``max_variants`` are left
    out of the refresh, and the sequence computed ends at the last chunk that has room."""
    docs = make_docs(3, seed=44)
    with Engine.from_model(
        tiny_model,
        tiny_tokenizer,
        sampling=SamplingParams(max_new_tokens=2),
        max_variants=2,
        warm_variants=2,
        **EVERY_SEQUENCE,
    ) as engine:
        engine.warm(docs[1:])  # two variants each: at the cap
        engine.warm(docs[:1])  # alone: one variant, room for another
        engine.generate(docs, PREFIX, SUFFIX)
        engine.flush()
        counts = engine.writeback.refresh_counts
        assert (counts["runs"], counts["chunks"], counts["at_cap"]) == (1, 1, 2)
        assert sources(engine.generate(docs, PREFIX, SUFFIX)) == ["tree", "store", "store"]
        engine.flush()  # chunk 0 exact now: the other two at the cap, nothing left to compute
        assert (counts["runs"], counts["at_cap"]) == (1, 4)


def test_without_tree_refresh_a_blended_sequence_stays_blended(tiny_model, tiny_tokenizer):
    docs = make_docs(3, seed=43)
    with Engine.from_model(
        tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2), tree_refresh=False
    ) as engine:
        engine.warm(docs[::-1])
        engine.generate(docs, PREFIX, SUFFIX)
        engine.flush()
        assert sources(engine.generate(docs, PREFIX, SUFFIX)) == ["store"] * 3
        assert engine.writeback.refresh_counts["runs"] == 0
    with pytest.raises(InvalidRequestError, match="tree_refresh"):
        Engine.from_model(tiny_model, tiny_tokenizer, tree_refresh="yes")


def test_background_work_gives_way_to_a_request_at_its_next_pause(engine):
    worker = engine._worker
    started, seen = threading.Event(), []

    def background(pause):
        started.set()
        try:
            while True:
                pause()
        except Preempted:
            seen.append("gave way")

    worker.post(Ticket(tokens=1, bounded=False, background=True), background)
    started.wait(timeout=30)
    assert worker.call(Ticket(tokens=1), lambda pause: "request ran") == "request ran"
    assert seen == ["gave way"]


def test_refreshes_wait_for_an_idle_engine_are_bounded_and_flush_runs_them(engine):
    """While the engine is busy, refreshes wait (at most MAX_REFRESHES; one more is dropped, counted),
    then run once it is idle."""
    sets = [make_docs(2, seed=50 + i) for i in range(MAX_REFRESHES + 1)]
    for docs in sets:
        engine.warm(docs[::-1])
    gate = hold_engine_thread(engine)
    callers = [threading.Thread(target=engine.generate, args=(docs, PREFIX, SUFFIX)) for docs in sets]
    for t in callers:  # queued behind the held thread, they run back to back: no idle time between
        t.start()
    wait_until(lambda: engine.queue_stats()["waiting"] == len(sets))
    gate.set()
    for t in callers:
        t.join(timeout=60)
    engine.flush()
    counts = engine.writeback.refresh_counts
    assert (counts["runs"], counts["dropped"], counts["chunks"]) == (MAX_REFRESHES, 1, 2 * MAX_REFRESHES)
    exact = [sources(engine.generate(docs, PREFIX, SUFFIX)) == ["tree", "tree"] for docs in sets]
    assert sum(exact) == MAX_REFRESHES


def test_closing_the_engine_drops_a_refresh_not_started(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2), **EVERY_SEQUENCE)
    caller, busy = refresh_waiting_behind_other_work(engine, seed=44)
    closing = threading.Thread(target=engine.close)
    closing.start()
    wait_until(lambda: engine.writeback._closing)
    busy.set()
    closing.join(timeout=60)
    caller.join(timeout=60)
    assert not closing.is_alive() and engine.writeback.refresh_counts["runs"] == 0


def test_at_exit_live_engines_finish_their_work_first(tiny_model, tiny_tokenizer):
    """A daemon thread still inside torch when the interpreter tears down aborts the process (exit
    code 134; `make demo` did): at exit, live engines drop waiting refreshes and finish the rest."""
    import kvrag.engine.serving.assembly as assembly

    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2), **EVERY_SEQUENCE)
    assert engine.parts in assembly._LIVE
    caller, busy = refresh_waiting_behind_other_work(engine, seed=45)
    threading.Timer(0.2, busy.set).start()
    engine.parts.quiesce(assembly.EXIT_WAIT_S)  # what the exit hook does for each live engine
    assert engine._worker._thread is None and not engine.writeback._refreshing
    assert engine.writeback.refresh_counts["runs"] == 0
    caller.join(timeout=60)
    engine.close()
    assert engine.parts not in assembly._LIVE


def refresh_waiting_behind_other_work(engine, seed: int) -> tuple[threading.Thread, threading.Event]:
    """A blended request has run and posted its refresh, which waits: foreground work holds the
    engine thread until the event returned is set. Returns the request's caller thread and the event."""
    docs = make_docs(3, seed=seed)
    engine.warm(docs[::-1])
    first = hold_engine_thread(engine)
    caller = threading.Thread(target=engine.generate, args=(docs, PREFIX, SUFFIX))
    caller.start()
    wait_until(lambda: engine.queue_stats()["waiting"] == 1)
    busy = threading.Event()  # more work behind the request: the engine is never idle
    threading.Thread(target=engine._worker.call, args=(Ticket(tokens=1), lambda pause: busy.wait())).start()
    first.set()
    wait_until(lambda: engine.writeback._refreshing)  # the request prefilled; its refresh waits
    return caller, busy


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_refresh_takes_no_room_from_what_requests_kept(tiny_model, tiny_tokenizer):
    """In a full store the refresh's exact variants are not kept (counted), and every entry the warm
    and the request kept stays; with one variant per chunk a refresh never replaces a chunk's KV
    (nor computes one: every chunk is at the cap)."""
    docs = make_docs(3, seed=44)
    with Engine.from_model(
        tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2), tree_refresh=False
    ) as probe:
        probe.warm(docs[::-1])
        probe.generate(docs, PREFIX, SUFFIX)
        probe.flush()
        held = probe.store.stats()["bytes"]  # warmed chunks and the prompt's prefix blocks
    for settings in (dict(memory_budget_bytes=held + 64), dict(max_variants=1)):
        with Engine.from_model(
            tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2), **settings, **EVERY_SEQUENCE
        ) as engine:
            engine.warm(docs[::-1])
            before = set(engine.store._items)
            engine.generate(docs, PREFIX, SUFFIX)
            engine.flush()
            counts = engine.writeback.refresh_counts
            full = "memory_budget_bytes" in settings
            want = (1, 0, 3, 0) if full else (0, 0, 0, 3)
            assert (counts["runs"], counts["chunks"], counts["not_kept"], counts["at_cap"]) == want, settings
            assert before <= set(engine.store._items)
            assert engine.store.stats()["speculative_refused"] == (3 if full else 0)
            assert sources(engine.generate(docs, PREFIX, SUFFIX)) == ["store"] * 3
