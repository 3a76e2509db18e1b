"""A request that finds nothing cached costs nothing over ``mode="full"`` (issue 60): the same tokens,
and what it leaves behind (write-back) is scheduled once its first token has reached the caller."""

from __future__ import annotations

import threading

import pytest

from tests.helpers import PREFIX, SUFFIX, as_dtype


@pytest.fixture(params=["float32", "bfloat16"])
def dtype_engine(request, tiny_model, tiny_tokenizer):
    from kvrag import Engine, SamplingParams

    engine = Engine.from_model(
        as_dtype(tiny_model, request.param), tiny_tokenizer, sampling=SamplingParams(max_new_tokens=16)
    )
    yield engine
    engine.close()


def test_a_0_hit_default_request_equals_mode_full_token_for_token(dtype_engine, docs):
    for n in (1, 3, 4):  # new documents each time: nothing cached (the store is emptied between)
        dtype_engine.flush()
        dtype_engine.store.clear()
        chunks = docs[-n:]
        full = dtype_engine.generate(chunks, PREFIX, SUFFIX, mode="full")
        default = dtype_engine.generate(chunks, PREFIX, SUFFIX)
        assert default.stats.chunk_hits == 0 and default.stats.path == "full"
        assert default.token_ids == full.token_ids and len(full.token_ids) == 16
        assert default.text == full.text


def test_write_back_is_scheduled_after_the_first_token_reaches_the_caller(tiny_engine, docs, monkeypatch):
    scheduled = []
    first_seen = threading.Event()
    inner = tiny_engine.writeback.schedule

    def schedule(plan, res):
        scheduled.append(first_seen.wait(timeout=10))  # the caller has the first piece by now
        inner(plan, res)

    monkeypatch.setattr(tiny_engine.writeback, "schedule", schedule)
    stream = tiny_engine.stream(docs[:2], PREFIX, SUFFIX, max_new_tokens=4, ignore_eos=True)
    for _ in stream:
        first_seen.set()
    assert scheduled == [True]
    tiny_engine.flush()
    assert tiny_engine.lookup(docs[:2], PREFIX, SUFFIX).chunks_stored == 2


def test_a_one_token_request_has_written_back_when_it_returns(tiny_engine, docs):
    # the caller's flush() right after the request returns must see its write-back queued
    tiny_engine.generate(docs[:3], PREFIX, SUFFIX, max_new_tokens=1)
    tiny_engine.flush()
    assert tiny_engine.lookup(docs[:3], PREFIX, SUFFIX).chunks_stored == 3


def test_a_failing_write_back_costs_no_answer(tiny_engine, docs, monkeypatch, caplog):
    want = tiny_engine.generate(docs[:2], PREFIX, SUFFIX, mode="full").token_ids

    def broken(plan, res):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny_engine.writeback, "schedule", broken)
    g = tiny_engine.generate(docs[:2], PREFIX, SUFFIX)
    assert g.token_ids == want
    assert "scheduling write-back failed" in caplog.text
    assert tiny_engine.lookup(docs[:2], PREFIX, SUFFIX).chunks_stored == 0


def test_a_0_hit_requests_stored_chunks_hold_its_pass_kv(dtype_engine, docs):
    # the values are read from the pass's buffer after the first token, not copied inside the pass:
    # what is stored is bit for bit what a full prefill of the prompt computes there
    import torch

    from kvrag import RequestOptions

    engine = dtype_engine
    engine.generate(docs[:3], PREFIX, SUFFIX, max_new_tokens=2)
    engine.flush()
    options = RequestOptions(mode="full", max_new_tokens=0)
    req = engine.requests.build(chunks=docs[:3], prefix=PREFIX, suffix=SUFFIX, options=options)
    _, _, res = engine.prefiller.run(req, capacity=req.num_tokens)
    chunks = [s for s in req.segments if s.kind == "chunk"]
    assert len(chunks) == 3
    for seg in chunks:
        rec = engine.store.get(engine.planner.chunk_key(seg.ids), seg.ids)
        assert rec is not None
        assert torch.equal(rec.v.to(res.buf.v.dtype), res.buf.v[:, :, seg.start : seg.end])
        assert rec.v.shape == (
            engine.adapter.n_layers,
            engine.adapter.n_kv_heads,
            len(seg.ids),
            engine.adapter.head_dim,
        )
