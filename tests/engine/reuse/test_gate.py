"""The correctness gate: every family passes it; a broken adapter is refused blend/reuse, loudly."""

from __future__ import annotations

import math

import pytest

from kvrag import Engine, SamplingParams, UnsupportedModelError
from kvrag.engine.model.adapter import ModelAdapter, Rotary
from kvrag.engine.reuse import gate
from tests.helpers import PREFIX, SUFFIX


def test_every_family_passes_the_gate(family_engine):
    assert family_engine.gate.ok, family_engine.gate


@pytest.fixture
def wrong_rope_base(monkeypatch):
    """The adapter's RoPE computed with base 20,000 where the model has 10,000."""
    real = ModelAdapter._rotaries

    def wrong(base, cfg):
        rotaries, kinds = real(base, cfg)
        power = math.log(20000.0) / math.log(10000.0)  # inv_freq = base ** (-2i/D)
        return [Rotary(r.inv_freq**power, r.scaling) for r in rotaries], kinds

    monkeypatch.setattr(ModelAdapter, "_rotaries", staticmethod(wrong))


def test_a_broken_adapter_is_refused_blend_and_reuse(tiny_model, tiny_tokenizer, docs, tmp_path, wrong_rope_base):
    engine = Engine.from_model(
        tiny_model, tiny_tokenizer, cache_dir=str(tmp_path), sampling=SamplingParams(max_new_tokens=4)
    )
    try:
        assert not engine.gate.ok and engine.gate.check == "placement"
        for mode in ("blend", "reuse"):
            with pytest.raises(UnsupportedModelError, match=rf"mode='{mode}'.*{engine.model_name}.*'placement'"):
                engine.generate(docs, PREFIX, SUFFIX, mode=mode, recompute_ratio=0.15)
        with pytest.raises(UnsupportedModelError, match="placement"):
            engine.score("the answer", docs, PREFIX, SUFFIX, mode="blend")
        with pytest.raises(UnsupportedModelError, match="placement"):  # the default: recompute_ratio="auto"
            engine.generate(docs, PREFIX, SUFFIX)
        # full and prefix still work, and blend at ratio 1.0 (a full prefill, nothing reused)
        for mode in ("full", "prefix"):
            assert engine.generate(docs, PREFIX, SUFFIX, mode=mode).stats.prompt_tokens > 0
        assert engine.generate(docs, PREFIX, SUFFIX, mode="blend", recompute_ratio=1.0).stats.cached_tokens == 0
    finally:
        engine.close()


def test_the_verdict_is_cached_per_model_and_adapter(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    runs = []
    real = gate.self_test
    monkeypatch.setattr(gate, "self_test", lambda *a: runs.append(1) or real(*a))
    for _ in range(2):
        Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path)).close()
    assert len(runs) == 1 and (tmp_path / "gate.json").is_file()
    # a changed adapter (here: a wrong RoPE base) is tested again, and its verdict kept apart
    real_rotaries = ModelAdapter._rotaries
    monkeypatch.setattr(
        ModelAdapter,
        "_rotaries",
        staticmethod(lambda b, c: ([Rotary(r.inv_freq * 0.5) for r in real_rotaries(b, c)[0]], real_rotaries(b, c)[1])),
    )
    broken = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
    broken.close()
    assert len(runs) == 2 and not broken.gate.ok
    monkeypatch.setattr(ModelAdapter, "_rotaries", staticmethod(real_rotaries))
    fixed = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
    fixed.close()
    assert len(runs) == 2 and fixed.gate.ok


def test_a_broken_last_layer_fails_the_ratio_check(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    """A bug that touches no KV (here the last layer's output shifted) leaves placement exact but
    not the logits: the ratio 1.0 check names it."""
    real = ModelAdapter.finish_layer

    def shifted(self, layer, h, attn):
        return real(self, layer, h, attn) + (0.5 if layer == self.n_layers - 1 else 0.0)

    monkeypatch.setattr(ModelAdapter, "finish_layer", shifted)
    engine = Engine.from_model(tiny_model, tiny_tokenizer, cache_dir=str(tmp_path))
    engine.close()
    assert not engine.gate.ok and engine.gate.check == "ratio 1.0"


def test_unknown_architectures_list_the_supported_ones():
    from transformers import AutoConfig

    from kvrag.engine.model.families import check_architecture

    with pytest.raises(
        UnsupportedModelError, match=r"'gpt2' is not supported.*llama.*mistral.*qwen2.*qwen3.*gemma3_text"
    ):
        check_architecture(AutoConfig.for_model("gpt2"))
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        check_architecture(AutoConfig.for_model("gemma3_text", final_logit_softcapping=30.0))
    with pytest.raises(UnsupportedModelError, match="activation 'gelu'"):
        check_architecture(AutoConfig.for_model("llama", hidden_act="gelu"))
