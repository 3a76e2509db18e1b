"""A prompt asked again computes nothing: its tail (after the last chunk) is kept with the hidden
state of its last token, behind exactly the tokens before it (``Plan.tail``)."""

from __future__ import annotations

import pytest

from kvrag import Engine, SamplingParams
from kvrag.engine.reuse.prefix import PrefixCache
from tests.helpers import PREFIX, SUFFIX, as_dtype, make_docs, make_tiny_model


def make(model, tok, **kw) -> Engine:
    return Engine.from_model(model, tok, sampling=SamplingParams(max_new_tokens=6), promotion_threshold=1, **kw)


def ask(engine: Engine, docs, suffix=SUFFIX, **kw):
    g = engine.generate(docs, PREFIX, suffix, **kw)
    engine.flush()  # the write-back (and a refresh) done before the next request
    return g


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_same_prompt_again_computes_nothing_and_answers_as_the_full_prefill(tiny_model, tiny_tokenizer, dtype):
    engine = make(as_dtype(tiny_model, dtype), tiny_tokenizer)
    with engine:
        docs = make_docs(3, seed=61)
        first = ask(engine, docs)  # cold: the whole prompt computed exactly, its tail kept
        assert first.stats.computed_tokens == first.stats.prompt_tokens
        again = ask(engine, docs)
        s = again.stats
        assert s.computed_tokens == 0 and s.cached_tokens == s.exact_tokens == s.prompt_tokens
        assert s.chunk_hits == 3
        full = ask(engine, docs, mode="full")
        assert again.token_ids == first.token_ids == full.token_ids
        other = ask(engine, docs, "tell me, " + SUFFIX)  # another question: its own tail computed
        assert 0 < other.stats.computed_tokens < other.stats.prompt_tokens
        assert other.token_ids == ask(engine, docs, "tell me, " + SUFFIX, mode="full").token_ids


def test_a_blended_prompt_keeps_no_tail_until_its_refresh_computes_it_exactly(tiny_model, tiny_tokenizer):
    """The tail of a blended prompt was computed behind approximate KV: not kept. The refresh
    computes the whole prompt exactly (the tail included), so the prompt again computes nothing and
    answers as a full prefill."""
    docs = make_docs(3, seed=62)
    for refresh in (False, True):
        engine = make(tiny_model, tiny_tokenizer, tree_refresh=refresh)
        with engine:
            engine.warm(docs[::-1])
            blended = ask(engine, docs)
            assert [c.source for c in blended.stats.chunks] == ["store"] * 3
            again = ask(engine, docs)
            if not refresh:
                assert again.stats.computed_tokens > 0 and again.stats.path == "blend"
                continue
            assert again.stats.computed_tokens == 0
            assert again.token_ids == ask(engine, docs, mode="full").token_ids


def test_prefix_mode_and_scoring_reuse_the_tail(tiny_model, tiny_tokenizer):
    engine = make(tiny_model, tiny_tokenizer)
    with engine:
        docs = make_docs(2, seed=63)
        ask(engine, docs, mode="prefix")
        again = ask(engine, docs, mode="prefix")
        assert again.stats.computed_tokens == 0 and again.stats.prefix_tokens < again.stats.prompt_tokens
        text = again.text or "x"
        reused = engine.score(text, docs, PREFIX, SUFFIX, mode="prefix")
        assert reused.stats.computed_tokens == 0
        full = engine.score(text, docs, PREFIX, SUFFIX, mode="full")
        assert reused.token_logprobs == pytest.approx(full.token_logprobs, abs=1e-5)


def test_the_tail_survives_the_disk_tier(tiny_model, tiny_tokenizer, tmp_path):
    """Read back from the disk (the memory tier cleared), the tail's hidden state still answers."""
    docs = make_docs(2, seed=64)
    with make(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path), disk_tier=True, loading_controller=False) as engine:
        first = ask(engine, docs)
    with make(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path), disk_tier=True, loading_controller=False) as engine:
        again = ask(engine, docs)
        assert again.stats.computed_tokens == 0 and again.token_ids == first.token_ids


def _separated(engine: Engine, docs: list[str]) -> str:
    engine.register(docs)
    return PREFIX + "\n--\n".join(docs) + "\n" + SUFFIX


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_text_between_chunks_is_held_like_the_tail(tiny_model, tiny_tokenizer, dtype):
    """A prompt with text between its documents (registered, found in ``prompt=``): that text is kept
    exactly too (``kind="gap"``, named by every token before it), so the prompt again computes
    nothing, and its answer is the full prefill's token for token, in bf16 too (a few rows computed
    over cached KV would round otherwise)."""
    engine = make(as_dtype(tiny_model, dtype), tiny_tokenizer)
    with engine:
        prompt = _separated(engine, make_docs(3, seed=65))
        first = engine.generate(prompt=prompt)
        engine.flush()
        again = engine.generate(prompt=prompt)
        engine.flush()
        s = again.stats
        assert s.computed_tokens == 0 and s.exact_tokens == s.prompt_tokens and s.chunk_hits == 3
        assert again.token_ids == first.token_ids == engine.generate(prompt=prompt, mode="full").token_ids


def test_text_between_chunks_and_the_tail_are_looked_up_only_behind_held_kv(tiny_model, tiny_tokenizer, monkeypatch):
    """A miss makes no lookup for its separators or its tail (with a remote tier each is a round
    trip): they are looked up only where everything before them is exact KV held in the cache."""
    looked: list[str] = []
    real = PrefixCache.lookup_tail

    def counted(self, before, tokens, **kw):
        looked.append(kw.get("kind", "tail"))
        return real(self, before, tokens, **kw)

    monkeypatch.setattr(PrefixCache, "lookup_tail", counted)
    engine = make(tiny_model, tiny_tokenizer)
    with engine:
        docs = make_docs(3, seed=68)
        prompt = _separated(engine, docs)
        cold = engine.generate(prompt=prompt)
        engine.flush()
        assert cold.stats.computed_tokens == cold.stats.prompt_tokens and looked == []
        again = engine.generate(prompt=prompt)
        engine.flush()
        assert again.stats.computed_tokens == 0 and sorted(looked) == ["gap", "gap", "tail"]
        looked.clear()
        other = _separated(engine, [make_docs(1, seed=69)[0]] + docs[1:])  # a new first document
        engine.generate(prompt=other)
        assert looked == []


def test_text_between_chunks_after_blended_kv_is_computed(tiny_model, tiny_tokenizer):
    """Text after a blended chunk was computed behind approximate KV: not reused as exact. Once the
    refresh has computed the prompt exactly, it is held, and the prompt again computes nothing."""
    engine = make(as_dtype(tiny_model, "bfloat16"), tiny_tokenizer)
    with engine:
        docs = make_docs(3, seed=67)
        prompt = _separated(engine, docs)
        engine.warm(docs[::-1])
        blended = engine.generate(prompt=prompt)
        assert blended.stats.path == "blend" and blended.stats.computed_tokens > 0
        engine.flush()  # the refresh: the whole prompt exactly, the text between chunks and the tail kept
        again = engine.generate(prompt=prompt)
        engine.flush()
        assert again.stats.computed_tokens == 0
        assert again.token_ids == engine.generate(prompt=prompt, mode="full").token_ids
        other = "\n==\n".join(docs)  # other separators: new text, computed; the chunks still exact
        changed = engine.generate(prompt=PREFIX + other + "\n" + SUFFIX)
        assert 0 < changed.stats.computed_tokens < changed.stats.prompt_tokens


def test_a_held_tail_gives_way_to_a_conversations_own_kv(tiny_model, tiny_tokenizer):
    """A prompt whose tail is held, asked as the next turn of a conversation: the turn's exact
    prefix reaches past the tail's start, so the tail is not used (its rows are computed behind the
    turn's KV), and the answer is the full prefill's."""
    engine = make(tiny_model, tiny_tokenizer)
    with engine:
        docs = make_docs(2, seed=66)
        engine.register(docs)
        system = {"role": "system", "content": "answer from the documents:\n" + "".join(docs)}
        p1 = engine.apply_chat_template([system, {"role": "user", "content": "where was the king born?"}])
        g1 = engine.generate(prompt=p1, conversation_id="c")
        engine.flush()
        p2 = engine.apply_chat_template(
            [
                system,
                {"role": "user", "content": "where was the king born?"},
                {"role": "assistant", "content": g1.text},
                {"role": "user", "content": "and the queen?"},
            ]
        )
        engine.generate(prompt=p2)  # no conversation: its tail kept
        engine.flush()
        assert engine.generate(prompt=p2).stats.computed_tokens == 0
        turn = engine.generate(prompt=p2, conversation_id="c")
        assert turn.stats.conversation_tokens > 0 and turn.stats.computed_tokens > 0
        assert turn.token_ids == engine.generate(prompt=p2, mode="full").token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_documents_stored_behind_another_question_answer_as_the_full_prefill(tiny_tokenizer, dtype):
    """The default engine (no ``deterministic`` slices), a RAG-sized prompt (over 1,024 tokens: rows
    attend with :func:`~kvrag.kernels.reference.aligned_attention`): documents computed exactly behind
    one question, then asked with another, reuse the documents' KV and compute the new question over
    it, and answer with the full prefill's tokens."""
    model = make_tiny_model(len(tiny_tokenizer), max_position_embeddings=2048)
    engine = make(as_dtype(model, dtype), tiny_tokenizer)
    with engine:
        docs = make_docs(3, words=400, seed=69)
        ask(engine, docs, "question: who built the bridge?<|im_end|>\n<|im_start|>assistant\n")
        got = ask(engine, docs)
        s = got.stats
        assert s.prompt_tokens > 1024 and s.exact_tokens > 1000 and 0 < s.computed_tokens < 60, s
        assert got.token_ids == ask(engine, docs, mode="full").token_ids
