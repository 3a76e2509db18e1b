"""The engine on the bundled SmolLM2-135M-Instruct: recompute ratio 1.0 is the full prefill, exactly."""

from __future__ import annotations

import torch

from tests.helpers import PREFIX, SUFFIX, last_logits, make_docs


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
