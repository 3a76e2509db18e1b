"""Multi-turn conversations on the tiny random Llama: kept KV, shifted history, dedup, LRU, errors."""

from __future__ import annotations

import pytest

from kvrag import Engine, InvalidRequestError, SamplingParams
from kvrag.engine.reuse.conversations import match_runs
from tests.helpers import make_docs

QUESTION1 = "where was the king born?"
QUESTION2 = "and where was the queen born?"


@pytest.fixture
def conv_engine(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(
        tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=10), max_conversations=2
    )
    yield engine
    engine.close()


def render(engine, messages):
    return engine.apply_chat_template(messages)


def docs_first(docs, history, question):
    system = {"role": "system", "content": "answer from the documents:\n" + "".join(docs)}
    return [system, *history, {"role": "user", "content": question}]


def append_only(turns):
    """turns: [(docs, question, answer or None)] -> messages with each turn's docs in its user message."""
    msgs = [{"role": "system", "content": "answer from the documents"}]
    for docs, question, answer in turns:
        msgs.append({"role": "user", "content": "".join(docs) + question})
        if answer is not None:
            msgs.append({"role": "assistant", "content": answer})
    return msgs


def test_match_runs_finds_shifted_runs():
    old = list(range(100))
    new = [500, 501] + list(range(10, 60)) + [700] * 3 + list(range(80, 90))
    runs = match_runs(old, new, 0, len(new), min_run=8)
    assert runs == [(2, 10, 50), (55, 80, 10)]
    assert match_runs(old, new, 0, len(new), min_run=16) == [(2, 10, 50)]


def test_append_only_history_is_an_exact_prefix(conv_engine):
    e = conv_engine
    docs = make_docs(5)
    e.register(docs)
    p1 = render(e, append_only([(docs[:2], QUESTION1, None)]))
    g1 = e.generate(prompt=p1, conversation_id="a")
    assert g1.stats.conversation_tokens == 0
    p2 = render(e, append_only([(docs[:2], QUESTION1, g1.text), (docs[2:4], QUESTION2, None)]))
    g2 = e.generate(prompt=p2, conversation_id="a")
    n1 = g1.stats.prompt_tokens
    # the whole previous prompt is reused exactly (no recompute), plus what of the answer re-tokenises alike
    assert g2.stats.prefix_tokens >= n1 and g2.stats.conversation_tokens >= n1
    assert g2.stats.cached_tokens >= g2.stats.conversation_tokens
    assert all(c.hit for c in g2.stats.chunks[:2])  # turn 1's docs are inside the reused prefix


def test_docs_first_history_is_reused_at_shifted_positions(conv_engine):
    e = conv_engine
    docs = make_docs(6)
    e.register(docs)
    g1 = e.generate(prompt=render(e, docs_first(docs[:3], [], QUESTION1)), conversation_id="d")
    history = [{"role": "user", "content": QUESTION1}, {"role": "assistant", "content": g1.text}]
    g2 = e.generate(prompt=render(e, docs_first([docs[3], docs[1], docs[4]], history, QUESTION2)), conversation_id="d")
    user_part = render(e, [{"role": "user", "content": QUESTION1}])  # the turn-1 user message + header
    assert g2.stats.conversation_tokens >= e.count_tokens(user_part)
    assert g2.stats.recomputed_tokens > 0  # history spans are blended (HKVD recompute), not trusted blindly
    # prefix mode reuses the exact prefix only; full reuses nothing
    g3 = e.generate(prompt=render(e, docs_first(docs[:2], history, QUESTION2)), conversation_id="d", mode="full")
    assert g3.stats.conversation_tokens == 0 and g3.stats.cached_tokens == 0


def condense(engine, question, answer, follow_up):
    """A chat engine's side call: its own template, the history quoted as text (LlamaIndex's condense)."""
    history = f"user: {question}\nassistant: {answer}"
    text = f"Rewrite the follow-up as a standalone question.\n{history}\nfollow-up: {follow_up}"
    return render(engine, [{"role": "user", "content": text}])


def test_a_side_call_is_served_without_the_conversation_and_does_not_replace_it(conv_engine):
    e = conv_engine
    docs = make_docs(5)
    e.register(docs)
    g1 = e.generate(prompt=render(e, append_only([(docs[:2], QUESTION1, None)])), conversation_id="s")
    side = e.generate(prompt=condense(e, QUESTION1, g1.text, QUESTION2), conversation_id="s")
    assert side.stats.conversation_tokens == 0 and side.stats.conversation_spans == []
    # the next turn continues turn 1, whose KV is still the conversation's main turn
    p2 = render(e, append_only([(docs[:2], QUESTION1, g1.text), (docs[2:4], QUESTION2, None)]))
    g2 = e.generate(prompt=p2, conversation_id="s")
    assert g2.stats.conversation_tokens >= g1.stats.prompt_tokens
    assert e.conversations.get(("default", "s")).turns == 2  # turn 1 + turn 2; the side call is kept beside them
    # and a side call with the same id after it still finds nothing of the conversation
    again = e.generate(prompt=condense(e, QUESTION2, g2.text, "who built the tower?"), conversation_id="s")
    assert again.stats.conversation_tokens == 0


def test_a_conversation_that_starts_over_follows_its_new_line(conv_engine):
    e = conv_engine
    docs = make_docs(5)
    e.register(docs)
    e.generate(prompt=render(e, append_only([(docs[:2], QUESTION1, None)])), conversation_id="o")
    b1 = e.generate(prompt=render(e, append_only([(docs[2:4], QUESTION2, None)])), conversation_id="o")
    assert b1.stats.conversation_tokens == 0  # a new first turn continues nothing: kept beside the old one
    p2 = render(e, append_only([(docs[2:4], QUESTION2, b1.text), (docs[4:], QUESTION1, None)]))
    b2 = e.generate(prompt=p2, conversation_id="o")
    assert b2.stats.conversation_tokens >= b1.stats.prompt_tokens
    main = e.conversations.get(("default", "o"))
    assert main.turns == 2 and main.prompt_len == b2.stats.prompt_tokens  # b1 then b2: the new line is the main one
    assert (
        e.conversations.kept(("default", "o"))[1].prompt_len == b1.stats.prompt_tokens
    )  # the turn it continued, beside it


def test_ratio_one_without_dedup_equals_full_prefill(conv_engine):
    e = conv_engine
    docs = make_docs(5)
    e.register(docs)
    turns = [(docs[:2], QUESTION1), (docs[1:3], QUESTION2), (docs[3:5], "who built the tower?")]
    done = []
    for d, q in turns:
        prompt = render(e, append_only(done + [(d, q, None)]))
        g = e.generate(prompt=prompt, conversation_id="r", recompute_ratio=1.0, dedup=False)
        ref = e.generate(prompt=prompt, mode="full")
        assert g.token_ids == ref.token_ids
        assert g.stats.cached_tokens == 0 and g.stats.deduplicated_chunks == 0
        done.append((d, q, g.text))


def test_dedup_drops_chunks_already_in_the_conversation(conv_engine):
    e = conv_engine
    docs = make_docs(4)
    e.register(docs)
    g1 = e.generate(prompt=render(e, append_only([(docs[:2], QUESTION1, None)])), conversation_id="x")
    p2 = render(e, append_only([(docs[:2], QUESTION1, g1.text), ([docs[1], docs[2]], QUESTION2, None)]))
    kept = e.generate(prompt=p2, conversation_id="x", dedup=False, max_new_tokens=1)
    e.end_conversation("x")
    e.generate(prompt=render(e, append_only([(docs[:2], QUESTION1, None)])), conversation_id="x")
    dropped = e.generate(prompt=p2, conversation_id="x", max_new_tokens=1)  # config default: dedup on
    assert kept.stats.deduplicated_chunks == 0 and dropped.stats.deduplicated_chunks == 1
    assert kept.stats.prompt_tokens - dropped.stats.prompt_tokens == e.count_tokens(docs[1])
    # docs-first: turn 1's docs are not in turn 2's prompt any more, so nothing is dropped
    e.generate(prompt=render(e, docs_first(docs[:2], [], QUESTION1)), conversation_id="y")
    g = e.generate(prompt=render(e, docs_first(docs[1:3], [], QUESTION2)), conversation_id="y", max_new_tokens=1)
    assert g.stats.deduplicated_chunks == 0


def test_live_conversations_are_bounded_and_can_be_ended(conv_engine):
    e = conv_engine
    for cid in ("one", "two", "three"):
        e.generate(prompt=f"hello {cid} the river and the mountain", conversation_id=cid, max_new_tokens=2)
    assert ("default", "one") not in e.conversations and len(e.conversations) == 2  # max_conversations=2, LRU
    assert e.end_conversation("two") is True
    assert e.end_conversation("two") is False
    assert len(e.conversations) == 1


def test_bad_conversation_arguments(conv_engine):
    with pytest.raises(InvalidRequestError, match="conversation_id"):
        conv_engine.generate(prompt="hello", conversation_id="")
    with pytest.raises(InvalidRequestError, match="conversation_id"):
        conv_engine.generate(prompt="hello", conversation_id=["a"])
    with pytest.raises(InvalidRequestError, match="dedup"):
        conv_engine.generate(prompt="hello", conversation_id="a", dedup="yes")
    with pytest.raises(InvalidRequestError, match="max_conversations"):
        conv_engine.config.replace(max_conversations=-1)
