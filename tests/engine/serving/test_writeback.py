"""The write-back queue is bounded: a job past the bound is dropped and counted, the answer unaffected."""

from __future__ import annotations

import threading

from kvrag import Engine, SamplingParams
from kvrag.engine.model.runner import KVBuffer
from kvrag.engine.serving import writeback
from kvrag.engine.serving.writeback import BackgroundWriter
from tests.helpers import PREFIX, SUFFIX, make_docs


def test_a_full_queue_drops_jobs_and_counts_them():
    w = BackgroundWriter(max_jobs=2, max_bytes=100)
    gate, ran = threading.Event(), []
    assert w.submit(gate.wait, 10)  # the thread is busy with this one
    assert w.submit(lambda: ran.append(1), 60)
    assert not w.submit(lambda: ran.append(2), 10)  # two jobs wait: full
    assert w.stats() == {"queued": 2, "queued_bytes": 70, "dropped": 1, "max_jobs": 2, "max_bytes": 100}
    w.max_jobs = 3
    assert not w.submit(lambda: ran.append(3), 40)  # 110 bytes past the bound
    gate.set()
    w.flush()
    assert ran == [1] and w.stats()["queued"] == 0 and w.stats()["queued_bytes"] == 0 and w.stats()["dropped"] == 2
    assert w.submit(lambda: ran.append(4), 1000)  # larger than the bound alone: taken into an empty queue
    w.flush()
    assert ran == [1, 4]


def test_answers_with_a_full_queue_equal_an_idle_engines(tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(writeback, "MAX_QUEUED_JOBS", 3)
    requests = [make_docs(2, seed=100 + i) for i in range(6)]  # each brings new documents
    answers = {}
    for saturated in (False, True):
        e = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=6))
        writer = e.writeback._writer
        gate = threading.Event()
        if saturated:  # the background thread is stuck on a job: the queue fills and stays full
            writer.submit(gate.wait)
        try:
            answers[saturated] = [e.generate(docs, PREFIX, SUFFIX).text for docs in requests]
            stats = e.writeback.stats()
            assert stats["queued"] <= 3
            if saturated:
                assert stats["dropped"] > 0 and stats["queued"] == 3
                held = list(_held(job for job, _ in list(writer._queue.queue)))
                assert held and not any(isinstance(v, KVBuffer) for v in held)  # not the request's KV buffer
        finally:
            gate.set()
            e.close()
    assert answers[True] == answers[False]


def _held(jobs):
    """What the queued jobs hold: their closures' and defaults' values, and what tuples of them hold."""
    for job in jobs:
        values = [c.cell_contents for c in job.__closure__ or ()] + list(job.__defaults__ or ())
        while values:
            value = values.pop()
            yield value
            if isinstance(value, (tuple, list)):
                values.extend(value)
