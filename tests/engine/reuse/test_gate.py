"""The correctness gate: every family passes it; a broken adapter is refused blend/reuse, loudly."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch

from kvrag import Engine, SamplingParams, UnsupportedModelError
from kvrag.engine.model.adapter import ModelAdapter, Rotary
from kvrag.engine.reuse import gate
from tests.helpers import FAMILIES, PREFIX, SUFFIX, as_dtype, make_tiny_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_family_passes_the_gate(family_model, tiny_tokenizer, tmp_path, dtype):
    with Engine.from_model(as_dtype(family_model, dtype), tiny_tokenizer, cache_dir=str(tmp_path)) as engine:
        assert engine.gate.ok and engine.gate.dtype == dtype, engine.gate.summary()
        m = engine.gate.measured
        for check in ("placement", "ratio 1.0"):
            assert m[check] <= m[f"{check} allowed"]
            if dtype == "float32":  # today's strictness: kvrag against transformers, both float32
                assert m[f"{check} allowed"] == gate.FLOAT32_TOL and f"{check} floor" not in m
            else:  # judged by the dtype's own noise: transformers' error in it against the float32 reference
                unit_roundoff = torch.finfo(getattr(torch, dtype)).eps / 2
                assert m[f"{check} allowed"] == pytest.approx(
                    gate.FLOOR_MULTIPLE * max(m[f"{check} floor"], unit_roundoff)
                )
                assert 0 < m[f"{check} floor"] < 0.2


def test_a_reduced_dtype_is_judged_by_its_own_noise(tiny_model, tiny_tokenizer):
    """kvrag's bf16 forward is transformers' bf16 forward, rounding for rounding: its ratio 1.0 error
    against the float32 reference is transformers' own, to the bit."""
    model = as_dtype(tiny_model, "bfloat16")
    result = gate.self_test(ModelAdapter(model), model, [tiny_tokenizer.bos_token_id])
    assert result.ok and result.measured["ratio 1.0"] == result.measured["ratio 1.0 floor"] > 0
    assert "placement" in result.summary() and "transformers' own" in result.summary()


@pytest.fixture
def wrong_rope_base(monkeypatch):
    """The adapter's RoPE computed with base 20,000 where the model has 10,000."""
    real = ModelAdapter._rotaries

    def wrong(base, cfg):
        rotaries, kinds = real(base, cfg)
        power = math.log(20000.0) / math.log(10000.0)  # inv_freq = base ** (-2i/D)
        return [Rotary(r.inv_freq**power, r.scaling) for r in rotaries], kinds

    monkeypatch.setattr(ModelAdapter, "_rotaries", staticmethod(wrong))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_broken_adapter_is_refused_blend_and_reuse(
    tiny_model, tiny_tokenizer, docs, tmp_path, wrong_rope_base, dtype
):
    model = as_dtype(tiny_model, dtype)
    engine = Engine.from_model(
        model, tiny_tokenizer, cache_dir=str(tmp_path), sampling=SamplingParams(max_new_tokens=4)
    )
    try:
        assert not engine.gate.ok and engine.gate.check == "placement" and engine.gate.dtype == dtype
        m = engine.gate.measured  # not a near miss: a wrong RoPE is far beyond any rounding noise
        assert m["placement"] > 10 * m["placement allowed"], engine.gate.summary()
        if dtype != "float32":
            assert "transformers' own" in engine.gate.detail and m["placement"] > 50 * m["placement floor"]
        assert not engine.info().gate_ok and engine.info().gate.startswith("failed 'placement'")
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


def test_a_damaged_cached_verdict_runs_the_test_again():
    good = gate.GateResult(True, dtype="bfloat16", measured={"placement": 0.01, "placement allowed": 0.03})
    assert gate._from_json(json.loads(json.dumps(asdict(good)))) == good
    for damaged in (None, [], {"ok": "yes"}, {"ok": True, "measured": {"placement": "x"}}, {"ok": True, "measured": 1}):
        assert gate._from_json(damaged) is None


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


@pytest.mark.parametrize("family", FAMILIES)
def test_the_float32_reference_runs_module_by_module_and_leaves_the_weights_as_they_were(family):
    """The gate's float32 reference without a float32 copy of the model: each module upcast just
    before it runs, given its own tensors back after: the very logits and KV a float32 copy gives, the
    weights unchanged and in the same storage (a copy per weight would double the model's memory while
    the engine holds the originals)."""
    import copy

    model = as_dtype(make_tiny_model(600, family), "bfloat16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storage = {k: v.data_ptr() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 600, (40,), generator=torch.Generator().manual_seed(3))
    probe = gate._Probe(ids, torch.cat([ids[:1], ids[10:20]]), 1, 10, 20)
    copy_kv, copy_logits = gate._transformers_run(copy.deepcopy(model).float(), probe)
    with gate._in_float32(model) as reference:
        kv, logits = gate._transformers_run(reference, probe)
    assert torch.equal(logits, copy_logits)
    assert all(torch.equal(a, b) for pair, other in zip(kv, copy_kv) for a, b in zip(pair, other))
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert {k: v.data_ptr() for k, v in after.items()} == storage
