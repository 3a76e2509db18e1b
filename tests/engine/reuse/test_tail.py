"""A prompt asked again computes nothing: its tail (after the last chunk) is kept with the hidden
state of its last token, behind exactly the tokens before it (``Plan.tail``)."""

from __future__ import annotations

import pytest

from kvrag import Engine, SamplingParams
from tests.helpers import PREFIX, SUFFIX, as_dtype, make_docs


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
