"""Exact means identical: a prompt answered from exactly stored KV gets the full prefill's tokens and
logits bit for bit (prefills in fixed slices: :mod:`kvrag.engine.reuse.slices`)."""

from __future__ import annotations

import pytest
import torch

from kvrag import Engine, SamplingParams
from kvrag.engine.reuse.slices import META_KEY, canonical_end, mark, plan_slices
from kvrag.engine.store.base import KVRecord
from tests.helpers import PREFIX, SUFFIX, as_dtype, last_logits, make_docs

SLICE = 32  # small, so that the tiny prompts (~200 tokens) span several slices


def make(model, tok, **kw) -> Engine:
    kw.setdefault("deterministic_slice_tokens", SLICE)
    kw.setdefault("deterministic", True)
    return Engine.from_model(model, tok, sampling=SamplingParams(max_new_tokens=12), **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_reuse_gives_the_full_prefills_tokens_and_logits_bit_for_bit(tiny_model, tiny_tokenizer, dtype):
    with make(as_dtype(tiny_model, dtype), tiny_tokenizer) as engine:
        docs = make_docs(3, seed=71)
        engine.generate(docs, PREFIX, "another question? " + SUFFIX)  # stores the documents exactly
        engine.flush()
        exact = last_logits(engine, docs, "blend")  # the exact path: prefix blocks and exact variants
        assert torch.equal(exact, last_logits(engine, docs, "full"))
        again = engine.generate(docs, PREFIX, SUFFIX)
        s = again.stats
        assert [c.source for c in s.chunks] == ["tree"] * 3 and s.recomputed_tokens == 0
        assert 0 < s.computed_tokens < s.prompt_tokens - SLICE  # whole slices reused
        assert s.exact_tokens + s.computed_tokens == s.prompt_tokens  # the stats say what ran: whole slices
        assert s.cached_tokens == s.exact_tokens  # nothing blended
        assert again.token_ids == engine.generate(docs, PREFIX, SUFFIX, mode="full").token_ids


def _rec(n: int, meta: dict) -> KVRecord:
    return KVRecord(torch.arange(n), torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), meta=meta)


def test_a_slice_is_reused_only_where_kv_computed_in_full_slices_of_its_size_covers_it():
    # a prefix block of 40 tokens computed by a 70-token prompt in slices of 32: [0, 64) is canonical
    block = _rec(40, mark({"parent": "p"}, 32, 64))
    assert canonical_end(block, 0, 32) == 40 and canonical_end(block, 30, 32) == 64
    assert canonical_end(block, 0, 16) == 0  # another slice size: nothing
    assert canonical_end(_rec(40, {"parent": "p"}), 0, 32) == 0  # unmarked (one pass, or a blend's)
    assert block.meta[META_KEY] == [32, 64]
    # slice [32, 64) has a hole at 40: computed whole, as is the prompt's last, partial slice
    assert plan_slices(80, 32, [(0, 40), (41, 70)]) == [(0, 32, True), (32, 64, False), (64, 80, False)]
    assert plan_slices(64, 32, [(0, 64)]) == [(0, 32, True), (32, 64, True)]


def test_an_exact_prefix_is_reused_up_to_the_last_slice_boundary_below_its_end(tiny_model, tiny_tokenizer):
    """A shorter prompt's whole exact prefix stored (prefix mode): a longer prompt with the same lead
    reuses its whole slices, computes the rest in the same slices, and matches the full prefill."""
    with make(as_dtype(tiny_model, "bfloat16"), tiny_tokenizer) as engine:
        docs = make_docs(3, seed=73)
        engine.generate(docs[:1], PREFIX, SUFFIX, mode="prefix")  # its whole exact prompt kept as prefix blocks
        engine.flush()
        g = engine.generate(docs, PREFIX, SUFFIX, mode="prefix")
        assert g.stats.prefix_tokens >= 2 * SLICE
        assert g.stats.computed_tokens == g.stats.prompt_tokens - (g.stats.prefix_tokens // SLICE) * SLICE
        assert torch.equal(last_logits(engine, docs, "prefix"), last_logits(engine, docs, "full"))
        assert g.token_ids == engine.generate(docs, PREFIX, SUFFIX, mode="full").token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_text_between_chunks_is_reused_in_whole_slices_too(tiny_model, tiny_tokenizer, dtype):
    """Text between the documents is kept exactly with the slices' mark: the same prompt again reuses
    every slice (nothing computed) and answers as the full prefill does."""
    with make(as_dtype(tiny_model, dtype), tiny_tokenizer) as engine:
        docs = make_docs(3, seed=73)
        engine.register(docs)
        prompt = PREFIX + "\n--\n".join(docs) + "\n" + SUFFIX
        first = engine.generate(prompt=prompt)
        engine.flush()
        again = engine.generate(prompt=prompt)
        assert again.stats.computed_tokens == 0 and again.stats.exact_tokens == again.stats.prompt_tokens
        assert again.token_ids == first.token_ids == engine.generate(prompt=prompt, mode="full").token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_blended_prompt_asked_again_after_its_refresh_reuses_its_slices(tiny_model, tiny_tokenizer, dtype):
    """Issue 60's "again" bug: a document a blend's one pass computed (missed, everything before it
    exact) was kept exact without the slice mark, the refresh skipped it, and the same prompt again
    recomputed its slices while its plan said exact. The refresh now recomputes such KV in slices."""
    with make(as_dtype(tiny_model, dtype), tiny_tokenizer, promotion_threshold=1) as engine:
        docs = make_docs(4, seed=75)
        engine.generate(docs[:2], PREFIX, SUFFIX)  # docs 0 and 1 computed exactly behind each other
        engine.flush()
        prompt = [docs[2], docs[1], docs[0]]  # doc 2 computed in the blend's one pass; 1 and 0 blended
        first = engine.generate(prompt, PREFIX, SUFFIX)
        assert [c.source for c in first.stats.chunks] == ["computed", "store", "store"]
        engine.flush()  # the idle-time refresh computes the prompt exactly, in slices
        again = engine.generate(prompt, PREFIX, SUFFIX)
        s = again.stats
        assert [c.source for c in s.chunks] == ["tree"] * 3 and s.recomputed_tokens == 0
        assert s.computed_tokens == 0 and s.exact_tokens == s.prompt_tokens  # every slice reused: the tail held
        assert again.token_ids == engine.generate(prompt, PREFIX, SUFFIX, mode="full").token_ids
        assert torch.equal(last_logits(engine, prompt, "blend"), last_logits(engine, prompt, "full"))
        other = engine.generate(prompt, PREFIX, "tell me, " + SUFFIX)  # another question: only its last slices
        tail = len(tiny_tokenizer("tell me, " + SUFFIX, add_special_tokens=False)["input_ids"])
        assert 0 < other.stats.computed_tokens <= tail + SLICE
        assert other.token_ids == engine.generate(prompt, PREFIX, "tell me, " + SUFFIX, mode="full").token_ids


def test_the_refresh_keeps_again_in_slices_the_lead_a_blend_kept(tiny_model, tiny_tokenizer):
    """A cold blend (every document warmed in other company) keeps the lead's prefix blocks from its
    one pass, unmarked: the planner takes them for not held, and the refresh keeps them in slices."""
    with make(as_dtype(tiny_model, "bfloat16"), tiny_tokenizer, promotion_threshold=1) as engine:
        docs = make_docs(3, seed=77)
        engine.warm(docs[::-1])
        first = engine.generate(docs, PREFIX, SUFFIX)
        assert [c.source for c in first.stats.chunks] == ["store"] * 3 and first.stats.prefix_tokens == 0
        engine.flush()
        again = engine.generate(docs, PREFIX, SUFFIX)
        assert again.stats.computed_tokens == 0 and again.stats.prefix_tokens > 0
        assert again.token_ids == engine.generate(docs, PREFIX, SUFFIX, mode="full").token_ids
