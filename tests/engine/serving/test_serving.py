"""Many callers at once: one engine thread, batched decode, prefill slices, bounds, cancellation."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import kvrag.engine.serving.prefill as prefill_module
from kvrag import Engine, OverloadedError, SamplingParams
from kvrag.engine.model.batch import Decoder, DecodeRow, decode_step
from kvrag.engine.model.runner import KVBuffer, forward
from tests.helpers import PREFIX, SUFFIX, hold_engine_thread, make_docs, prompt_ids


@pytest.fixture
def serving(tiny_model, tiny_tokenizer):
    """An engine that runs a decode step at every pause of a prefill while streams are running."""
    engine = Engine.from_model(
        tiny_model, tiny_tokenizer, prefill_slice_s=0.0, sampling=SamplingParams(max_new_tokens=8)
    )
    yield engine
    engine.close()


@pytest.fixture
def events(monkeypatch):
    """What the engine thread did, in order: ("prefill", prompt tokens), ("prefilled", ...), ("step", bufs)."""
    log: list[tuple] = []
    prefill, step = prefill_module.prefill, Decoder.step

    def spy_prefill(adapter, plan, capacity, **kw):
        log.append(("prefill", plan.num_tokens))
        res = prefill(adapter, plan, capacity, **kw)
        log.append(("prefilled", plan.num_tokens))
        return res

    def spy_step(decoder, rows):
        log.append(("step", [weakref.ref(r.buf) for r in rows]))
        return step(decoder, rows)

    monkeypatch.setattr(prefill_module, "prefill", spy_prefill)
    monkeypatch.setattr(Decoder, "step", spy_step)
    return log


def token_ids(stream) -> list[int]:
    for _ in stream:
        pass
    return stream.generation.token_ids


REQUESTS = [  # (chunks, request arguments)
    (make_docs(2, seed=31), dict(mode="full", max_new_tokens=20)),
    (make_docs(3, seed=32), dict(mode="blend", max_new_tokens=12)),
    (make_docs(2, seed=33), dict(mode="reuse", max_new_tokens=25)),
    (make_docs(2, seed=34), dict(mode="prefix", max_new_tokens=16)),
    (make_docs(3, seed=35), dict(mode="blend", selection="recency", max_new_tokens=30)),
    ([], dict(mode="full", max_new_tokens=18)),
]


def test_concurrent_greedy_streams_equal_each_alone(serving, events):
    for chunks, args in REQUESTS:
        serving.warm(chunks)
        serving.generate(chunks, PREFIX, SUFFIX, **args)  # keeps its prefix blocks: the cache is settled
    serving.flush()
    alone = [serving.generate(chunks, PREFIX, SUFFIX, **args).token_ids for chunks, args in REQUESTS]
    events.clear()
    gate = hold_engine_thread(serving)  # all queued before the engine takes the first (a busy machine is slow to queue)
    streams = [serving.stream(chunks, PREFIX, SUFFIX, **args) for chunks, args in REQUESTS]
    results: dict[int, list[int]] = {}

    def consume(i):
        results[i] = token_ids(streams[i])

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(REQUESTS))] == alone
    assert max(len(e[1]) for e in events if e[0] == "step") >= 3  # they did decode together


def rows_of(engine, prompts, tokens):
    """A KV buffer per prompt, prefilled, and the decode row that appends ``tokens[i]`` to it."""
    out = []
    for ids, token in zip(prompts, tokens):
        n = len(ids)
        buf = KVBuffer(engine.adapter, n + 1)
        forward(engine.adapter, buf, ids, torch.arange(n), n)
        out.append(DecodeRow(buf, token, n))
    return out


def check_batched_step(engine, lengths) -> None:
    """A batched decode step gives each row what it gives the row alone, and the model's own next-token logits."""
    torch.manual_seed(0)
    prompts = [torch.randint(5, 500, (n,)) for n in lengths]
    tokens = [7 + i for i in range(len(prompts))]
    alone = [decode_step(engine.adapter, [row], 8)[0] for row in rows_of(engine, prompts, tokens)]
    for order in ([3, 1, 4], [10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]):  # one padded group; two groups
        rows = rows_of(engine, [prompts[i] for i in order], [tokens[i] for i in order])
        batched = decode_step(engine.adapter, rows, 8)
        assert all(torch.equal(batched[j], alone[i]) for j, i in enumerate(order))
        assert all(r.buf.length == r.pos + 1 for r in rows)
    with torch.inference_mode():
        theirs = engine.hf_model(torch.cat((prompts[1], torch.tensor([tokens[1]])))[None]).logits[0, -1]
    torch.testing.assert_close(alone[1], theirs.float(), rtol=1e-4, atol=1e-4)


def test_a_batched_decode_step_equals_each_row_decoded_alone(tiny_engine):
    check_batched_step(tiny_engine, (37, 80, 5, 121, 64, 9, 33, 100, 50, 12, 77))


def test_a_batched_decode_step_on_each_family(family_engine):
    # rows longer than the tiny models' sliding windows (40-48): each layer's own window and RoPE
    check_batched_step(family_engine, (37, 90, 5, 121, 64, 9, 33, 100, 50, 12, 77))


def test_a_full_queue_raises_overloaded_and_the_engine_goes_on(tiny_model, tiny_tokenizer, docs):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, max_queued=2, sampling=SamplingParams(max_new_tokens=4))
    try:
        gate = hold_engine_thread(engine)
        waiting = [engine.stream(docs[:1], PREFIX, SUFFIX), engine.stream(docs[1:2], PREFIX, SUFFIX)]
        with pytest.raises(OverloadedError, match="max_queued=2"):
            engine.stream(docs[2:3], PREFIX, SUFFIX)
        with pytest.raises(OverloadedError):
            engine.score("the king", docs[:1], PREFIX, SUFFIX)
        gate.set()
        for s in waiting:
            assert "".join(s) == s.generation.text
        assert engine.generate(docs[2:3], PREFIX, SUFFIX).stats.prompt_tokens > 0
    finally:
        engine.close()


def test_closing_a_stream_frees_its_slot_and_kv(tiny_model, tiny_tokenizer, docs, events):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, max_running=1)
    try:
        first = engine.stream(prefix="the king was born in", max_new_tokens=900, mode="full")
        next(first)
        first.close()  # it decodes no more and gives its one slot up
        later = engine.generate(docs[:2], PREFIX, SUFFIX, mode="full", max_new_tokens=5)
        assert len(later.token_ids) == 5
        steps = [e[1] for e in events if e[0] == "step"]
        first_buf = steps[0][0]  # weakref.ref(x) is one object per x: == finds it after x is gone too
        assert sum(first_buf in s for s in steps) < 899
        gc.collect()
        assert first_buf() is None  # its KV is gone
        # a waiting request that is closed never runs
        gate = hold_engine_thread(engine)
        gone = engine.stream(docs[2:], PREFIX, SUFFIX, mode="full")
        gone.close()
        prefills = sum(e[0] == "prefill" for e in events)
        gate.set()
        assert engine.generate(docs[:1], PREFIX, SUFFIX, mode="full").token_ids
        assert sum(e[0] == "prefill" for e in events) == prefills + 1
    finally:
        engine.close()


def test_closing_a_stream_wakes_its_consumer_on_another_thread(tiny_engine):
    stream = tiny_engine.stream(prefix="the king was born in", max_new_tokens=900, mode="full")
    got, first, finished = [], threading.Event(), threading.Event()

    def consume():
        for piece in stream:
            got.append(piece)
            first.set()
        finished.set()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert first.wait(30), "the stream gave no first piece"
    gate = hold_engine_thread(tiny_engine)  # no piece comes now: the consumer waits for one
    stream.close()
    assert finished.wait(10), "the consumer still waits for a piece of a closed stream"
    gate.set()
    assert stream.generation is None and len(got) < 900
    assert tiny_engine.generate(prefix="the king", max_new_tokens=2, mode="full").token_ids  # the engine goes on


def test_a_long_prefill_runs_between_another_streams_decode_steps(serving, events):
    running = serving.stream(prefix="the king was born in", max_new_tokens=600, mode="full")
    next(running)
    long_doc = make_docs(1, words=500, seed=40)
    n = len(prompt_ids(serving, long_doc))
    serving.generate(long_doc, PREFIX, SUFFIX, mode="full", max_new_tokens=1)
    running.close()
    begin, end = events.index(("prefill", n)), events.index(("prefilled", n))
    steps = [e for e in events[begin:end] if e[0] == "step"]
    # a decode step after each layer's attention and after its MLP (prefill_slice_s=0)
    assert len(steps) >= 2 * serving.adapter.n_layers


def test_warm_score_and_write_back_run_beside_streams(tiny_model, tiny_tokenizer):
    # chunk_context="sink": a missed chunk's KV is computed again for write-back (on the engine thread)
    engine = Engine.from_model(tiny_model, tiny_tokenizer, chunk_context="sink", prefill_slice_s=0.0)
    try:
        docs, others, scored = make_docs(2, seed=51), make_docs(3, seed=52), make_docs(2, seed=53)
        expected_stream = engine.generate(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=40).token_ids
        expected_score = engine.score("the river", scored, PREFIX, SUFFIX, mode="full").logprob
        streams = [engine.stream(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=40) for _ in range(2)]
        out = {}
        calls = {
            "warm": lambda: engine.warm(others),
            "score": lambda: engine.score("the river", scored, PREFIX, SUFFIX, mode="full"),
            "miss": lambda: engine.generate(make_docs(2, seed=54), PREFIX, SUFFIX, max_new_tokens=3),
        }
        threads = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f())) for k, f in calls.items()]
        for t in threads:
            t.start()
        tokens = [token_ids(s) for s in streams]
        for t in threads:
            t.join()
        engine.flush()
        assert tokens == [expected_stream, expected_stream]
        assert out["score"].logprob == expected_score
        assert out["warm"].computed == 3
        assert out["miss"].stats.chunk_misses == 2
        again = engine.generate(make_docs(2, seed=54), PREFIX, SUFFIX, max_new_tokens=1)
        assert again.stats.chunk_hits == 2  # written back
    finally:
        engine.close()


@pytest.mark.model
def test_concurrent_streams_equal_each_alone_on_the_bundled_model(smol_engine):
    requests = [make_docs(3, words=80, seed=60 + i) for i in range(4)]
    alone = [smol_engine.generate(r, PREFIX, SUFFIX, mode="full").token_ids for r in requests]
    streams = [smol_engine.stream(r, PREFIX, SUFFIX, mode="full") for r in requests]
    together = [token_ids(s) for s in streams]
    assert together == alone


def test_busy_time_counts_the_engine_threads_work_not_its_idle_gaps(tiny_engine):
    assert tiny_engine.queue_stats()["busy_s"] == 0  # no work yet
    tiny_engine.generate(make_docs(2, seed=41), PREFIX, SUFFIX, max_new_tokens=3)
    tiny_engine.flush()
    assert tiny_engine._worker.wait_idle(10)
    busy = tiny_engine.queue_stats()["busy_s"]
    assert busy > 0
    gate = hold_engine_thread(tiny_engine)  # a running job counts while it runs
    threading.Event().wait(0.02)
    assert tiny_engine.queue_stats()["busy_s"] > busy
    gate.set()
    assert tiny_engine._worker.wait_idle(10)
    idle = tiny_engine.queue_stats()["busy_s"]
    threading.Event().wait(0.05)
    assert tiny_engine.queue_stats()["busy_s"] == idle  # idle time is not busy time


def test_the_engine_thread_computes_with_the_engines_threads_whatever_the_caller_set_since(tiny_engine):
    n = torch.get_num_threads()
    assert tiny_engine.info().threads == tiny_engine.threads == n  # torch's count when it was built
    try:
        torch.set_num_threads(n + 1)  # the caller's own work, after the engine was built
        on_engine = tiny_engine._run_internal(lambda pause: torch.get_num_threads(), 1)
        assert on_engine == n
        assert tiny_engine.generate(chunks=make_docs(2), suffix=SUFFIX).token_ids  # and it still serves
    finally:
        torch.set_num_threads(n)


def test_an_idle_engine_thread_lingers_for_the_next_request_then_ends(tiny_engine):
    ran_on = []
    tiny_engine._run_internal(lambda pause: ran_on.append(threading.current_thread()), 1)
    assert tiny_engine._worker.wait_idle(10)
    first = ran_on[0]
    assert first.is_alive() and first.name == "kvrag-engine"  # idle, waiting for more
    tiny_engine.generate(chunks=make_docs(2), suffix=SUFFIX)
    tiny_engine._run_internal(lambda pause: ran_on.append(threading.current_thread()), 1)
    assert ran_on[1] is first  # the next work ran on the same thread (its OpenMP pool kept)
    assert tiny_engine.queue_stats()["running"] == 0 and tiny_engine._worker.wait_idle(10)
    with tiny_engine._worker._cond:
        tiny_engine._worker._linger = 0.05  # a short linger: the thread ends on its own
        tiny_engine._worker._cond.notify_all()
    first.join(10)
    assert not first.is_alive() and tiny_engine._worker._thread is None
    tiny_engine._run_internal(lambda pause: ran_on.append(threading.current_thread()), 1)
    assert ran_on[2] is not first  # a new thread for new work


def test_close_ends_a_lingering_engine_thread(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2))
    engine.generate(chunks=make_docs(2), suffix=SUFFIX)
    thread = engine._worker._thread
    assert thread is not None and thread.is_alive()
    engine.close()
    assert engine._worker._thread is None and not thread.is_alive()


def test_work_on_another_engine_ends_an_idle_engines_linger(tiny_model, tiny_tokenizer):
    a = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2))
    b = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2))
    try:
        a.generate(chunks=make_docs(2), suffix=SUFFIX)
        a.flush()  # its write-back done: a's thread is idle, lingering
        assert a._worker.wait_idle(10)
        lingering = a._worker._thread
        assert lingering is not None and lingering.is_alive()
        b.generate(chunks=make_docs(2), suffix=SUFFIX)  # b's thread starts: a's does not keep its pool beside it
        lingering.join(0.5)  # well before a's own linger would have run out
        assert not lingering.is_alive() and a._worker._thread is None
        assert a.generate(chunks=make_docs(2), suffix=SUFFIX).token_ids  # a still serves, on a new thread
    finally:
        a.close()
        b.close()


def test_release_ends_an_idle_engine_thread_now(tiny_engine):
    tiny_engine.generate(chunks=make_docs(2), suffix=SUFFIX)
    tiny_engine.flush()
    assert tiny_engine._worker.wait_idle(10)
    thread = tiny_engine._worker._thread
    assert thread is not None and thread.is_alive()
    assert tiny_engine._worker.release(timeout=10)
    thread.join(10)
    assert not thread.is_alive() and tiny_engine._worker._thread is None
    assert tiny_engine.generate(chunks=make_docs(2), suffix=SUFFIX).token_ids  # the next work, on a new thread


def test_ignore_eos_decodes_every_token_past_an_end_token(tiny_engine, docs):
    """With an end token in its way, a request stops there; ``ignore_eos`` decodes all its tokens
    (the same ones the model picks), and a stop string still stops it."""
    free = tiny_engine.generate(docs[:2], "q:", " a:", max_new_tokens=6)
    assert len(free.token_ids) == 6
    end = free.token_ids[1]
    eos, tiny_engine._worker.eos_ids = tiny_engine._worker.eos_ids, {end}
    try:
        stopped = tiny_engine.generate(docs[:2], "q:", " a:", max_new_tokens=6)
        assert stopped.token_ids == free.token_ids[: free.token_ids.index(end)] and stopped.finish_reason == "stop"
        every = tiny_engine.generate(docs[:2], "q:", " a:", max_new_tokens=6, ignore_eos=True)
        assert every.token_ids == free.token_ids and every.finish_reason == "length"
    finally:
        tiny_engine._worker.eos_ids = eos


def test_a_kept_engine_thread_starts_with_the_engine_and_stays_until_close(tiny_model, tiny_tokenizer):
    a = Engine.from_model(tiny_model, tiny_tokenizer, thread_linger_s=None, sampling=SamplingParams(max_new_tokens=2))
    b = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2))
    try:
        kept = a._worker._thread
        assert kept is not None and kept.is_alive()  # started by the builder, before any request
        ran_on = []
        a._run_internal(lambda pause: ran_on.append(threading.current_thread()), 1)
        assert ran_on == [kept] and a._worker.wait_idle(10)
        b.generate(chunks=make_docs(2), suffix=SUFFIX)  # another engine's work does not end it
        assert not a._worker.release(timeout=0.1)  # nor does release()
        kept.join(1.2)  # past the default linger
        assert kept.is_alive() and a.generate(chunks=make_docs(2), suffix=SUFFIX).token_ids
        assert a._worker._thread is kept
    finally:
        a.close()
        b.close()
    assert not kept.is_alive() and a._worker._thread is None
