"""Tenants by construction: registry, conversations and speculations keyed by (namespace, id)."""

from __future__ import annotations

import dataclasses

import pytest

from kvrag import Engine, InvalidRequestError, SamplingParams
from kvrag.engine.reuse.documents import MAX_PER_ANCHOR, DocumentFinder
from tests.helpers import PREFIX, SUFFIX, hold_engine_thread, make_docs

TIMING = {"prefill_s", "decode_s"}


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    e = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=4), max_conversations=4)
    yield e
    e.close()


def test_no_conversation_id_reaches_another_tenants_conversation(engine):
    engine.generate(prompt=PREFIX + SUFFIX, conversation_id="c", namespace="a", max_new_tokens=2)
    # the old key of a's conversation was "a\0c": a default-namespace caller could read, overwrite or end it
    for bad in ("a\0c", "c\x1b", "\x7f", "x\ny"):
        with pytest.raises(InvalidRequestError, match="control characters"):
            engine.end_conversation(bad)
        with pytest.raises(InvalidRequestError, match="control characters"):
            engine.generate(prompt=PREFIX, conversation_id=bad, max_new_tokens=1)
    with pytest.raises(InvalidRequestError, match="namespace"):
        engine.generate(prompt=PREFIX, namespace="a\0", max_new_tokens=1)
    assert not engine.end_conversation("c")  # the default tenant's "c" is another conversation
    assert not engine.end_conversation("c", namespace="b")
    assert ("a", "c") in engine.conversations
    assert engine.end_conversation("c", namespace="a")


def test_a_tenants_new_conversations_end_only_its_own_once_it_holds_the_most(engine):
    engine.generate(prompt=PREFIX + SUFFIX, conversation_id="b1", namespace="b", max_new_tokens=1)
    for i in range(10):  # a opens many conversations; max_conversations=4
        engine.generate(prompt=f"{PREFIX} {i}", conversation_id=f"a{i}", namespace="a", max_new_tokens=1)
    assert ("b", "b1") in engine.conversations  # a global LRU ended b's conversation
    assert engine.conversations.held("a") == 3 and len(engine.conversations) == 4


def test_tenant_b_cannot_tell_whether_a_registered_a_text(tiny_model, tiny_tokenizer):
    doc = make_docs(1, seed=5)[0]
    prompt = f"{PREFIX}{doc}{SUFFIX}"
    answers = []
    for registered_by_a in (False, True):
        e = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=4))
        try:
            if registered_by_a:
                e.register([doc], namespace="a")
                e.generate(prompt=prompt, namespace="a")  # a's chunk is now cached, under a
                e.flush()
            g = e.generate(prompt=prompt, namespace="b")
            answers.append((g.text, {k: v for k, v in dataclasses.asdict(g.stats).items() if k not in TIMING}))
            assert e.split_prompt(prompt, namespace="b") == [("text", prompt)]
            assert e.split_prompt(prompt, namespace="a")[1] == ("chunk", doc) if registered_by_a else True
        finally:
            e.close()
    assert answers[0] == answers[1]


def test_a_tenant_registering_more_than_any_other_pushes_out_only_its_own_texts():
    reg = DocumentFinder(max_entries=10, min_chars=8, anchor=8)
    b_texts = [f"b's own document {i}" for i in range(3)]
    reg.register(b_texts, namespace="b")
    reg.register([f"{i:04d} a's flood of texts" for i in range(100)], namespace="a")
    assert all(reg.holds(t, "b") for t in b_texts) and reg.count("a") == 7 and len(reg) == 10
    assert not reg.holds(b_texts[0], "a") and reg.split(b_texts[0], "a") == [("text", b_texts[0])]


def _buckets(reg: DocumentFinder):
    stack = [b for t in reg._tenants.values() for b in t.by_anchor.values()]
    while stack:
        bucket = stack.pop()
        yield bucket
        stack.extend((bucket.children or {}).values())


def test_registration_of_texts_sharing_an_anchor_is_bounded_work():
    reg = DocumentFinder()
    anchor = "Source: https://en.wikipedia.org/wiki/"  # a corpus whose texts all open alike
    texts = [f"{anchor}Article_{i} " + f"body of article {i} " * 4 for i in range(5000)]
    reg.register(texts)
    assert len(reg) == 5000 and all(len(b.texts) <= MAX_PER_ANCHOR for b in _buckets(reg))
    for i in (0, 1234, 4999):  # each still found, the longest match at its place
        assert reg.split(f"q: {texts[i]} q")[1] == ("chunk", texts[i])
    # texts alike up to their last characters: too short to split by a longer prefix, the least
    # recently registered of them are forgotten past the bound (a quadratic bucket before)
    short = [f"{'x' * 32}{i:05d}" for i in range(5000)]
    reg.register(short)
    assert sum(reg.holds(t) for t in short) == MAX_PER_ANCHOR and reg.holds(short[-1])
    assert all(len(b.texts) <= MAX_PER_ANCHOR for b in _buckets(reg))


def test_a_prompt_far_past_the_window_is_refused_before_it_is_scanned(engine, monkeypatch):
    def scan(*args, **kwargs):
        raise AssertionError("the prompt was scanned for documents")

    monkeypatch.setattr(engine.documents, "split", scan)
    huge = "word " * (engine.context_window * 2 * engine.prompt_tokenizer.max_token_chars)
    with pytest.raises(InvalidRequestError, match="context window"):
        engine.generate(prompt=huge)


def test_speculations_are_scoped_to_their_tenant_and_shared_fairly(engine, monkeypatch):
    from kvrag.engine.serving import speculation

    monkeypatch.setattr(speculation, "MAX_LIVE", 3)
    gate = hold_engine_thread(engine)
    start = engine.speculations.start
    b = start("prompt", "k", 1, lambda h, p: None, namespace="b")
    a_same_key = start("prompt", "k", 1, lambda h, p: None, namespace="a")
    assert b.state == "waiting"  # the same key of another tenant replaces nothing
    a = [start("prompt", i, 1, lambda h, p: None, namespace="a") for i in range(4)]
    assert b.state == "waiting" and a_same_key.state == "cancelled"  # a's flood cancels its own oldest
    assert not engine.speculations.cancel_key("k", namespace="c") and b.state == "waiting"
    assert engine.speculations.cancel_key("k", namespace="b") and b.state == "cancelled"
    gate.set()
    assert all(h.wait(10) for h in a[2:])


def test_a_full_table_never_drops_the_entry_being_added():
    reg = DocumentFinder(max_entries=1, min_chars=8, anchor=8)
    reg.register(["a's only document"], namespace="a")
    reg.register(["b's only document"], namespace="b")  # a tie after the insert: b holds nothing to give
    assert reg.holds("b's only document", "b") and not reg.holds("a's only document", "a") and len(reg) == 1
