"""Weight-only quantized decode (``weights="int8"`` / ``"int4"``): within a stated tolerance of the
bf16 step, a row's result independent of the other rows, refused where the kernels are not."""

from __future__ import annotations

import pytest
import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.batch import Decoder, decode_step
from kvrag.engine.model.quantized import Int4Linear, Int8Linear, QuantizedWeights
from tests.engine.model.test_decode import LENGTHS, rows_for
from tests.helpers import FAMILIES, as_dtype, make_tiny_model

#: A quantized step's distance from the float32 step (relative L2 over a row's logits) may be this
#: many times the bf16 step's own, on weights that lie on a 4-bit grid of 32 inputs, as a Q4 GGUF's
#: do (measured on the tiny models: 0.6-2.0x; on random weights off any grid, int4 is ~10x worse).
TOLERANCE = 2.5


def on_4bit_grid(model, group: int = 32):
    """``model`` with each matrix's groups of ``group`` inputs snapped to 16 levels between their
    minimum and maximum: what the weights of a 4-bit quantized checkpoint are."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and p.shape[1] % group == 0:
                w = p.float().reshape(p.shape[0], -1, group)
                low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
                scale = ((high - low) / 15).clamp(min=1e-8)
                p.copy_((torch.round((w - low) / scale) * scale + low).reshape(p.shape))
    return model


def bf16_adapter(family: str = "llama", model=None) -> ModelAdapter:
    model = model if model is not None else make_tiny_model(608, family)  # 608 outputs: 4-bit packs by 16
    return ModelAdapter(as_dtype(model, "bfloat16"))


def quantized(adapter: ModelAdapter, fmt: str) -> Decoder:
    decoder = Decoder(adapter, 8, weights=fmt)
    if not decoder.unpadded:
        pytest.skip(f"no {fmt} decode here: {decoder.description}")
    return decoder


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_quantized_step_stays_near_the_float32_step_as_the_bf16_step_does(family, fmt):
    model = on_4bit_grid(make_tiny_model(608, family))
    exact, adapter = ModelAdapter(model), bf16_adapter(model=model)
    decoder = quantized(adapter, fmt)
    assert decoder.description.startswith(f"quantized: {fmt} weight-only")
    torch.manual_seed(1)
    prompts = [torch.randint(5, 500, (n,)) for n in LENGTHS]
    truth = decode_step(exact, rows_for(exact, prompts, 1), 8)
    bf16 = decode_step(adapter, rows_for(adapter, prompts, 1), 8)
    got = decoder.step(rows_for(adapter, prompts, 1))

    def off(x: torch.Tensor) -> float:
        return ((x - truth).norm(dim=-1) / truth.norm(dim=-1)).max().item()

    assert off(got) <= TOLERANCE * off(bf16), (family, fmt, off(got), off(bf16))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_step_runs_its_rows_only_and_a_row_never_depends_on_the_others(fmt):
    adapter = bf16_adapter()
    decoder = quantized(adapter, fmt)
    torch.manual_seed(2)
    prompts = [torch.randint(5, 500, (n,)) for n in LENGTHS[:5]]
    alone, together = rows_for(adapter, prompts[:1], 1), rows_for(adapter, prompts, 1)
    assert torch.equal(decoder.step(alone)[0], decoder.step(together)[0])


def test_the_linears_approximate_their_weights_and_refuse_what_they_cannot_pack():
    torch.manual_seed(0)
    w, x = torch.randn(96, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    exact = x.float() @ w.float().T
    for linear, bound in ((Int8Linear(w, None), 0.01), (Int4Linear(w, None), 0.12)):
        got = linear(x).float()
        assert (got - exact).norm() / exact.norm() < bound
    assert Int8Linear(w, None).nbytes < w.nbytes and Int4Linear(w, None).nbytes < Int8Linear(w, None).nbytes
    with pytest.raises(ValueError, match="4-bit packing needs"):
        Int4Linear(torch.randn(40, 64), None)  # outputs not by 16


def test_quantized_weights_are_refused_where_the_kernels_do_not_run():
    adapter = ModelAdapter(make_tiny_model(608))  # float32: the kernels take bfloat16 activations
    weights, why = QuantizedWeights.build(adapter, "int8")
    assert weights is None and why.startswith("float32 compute")
    decoder = Decoder(adapter, 8, weights="int8")  # the engine falls back to the packed (or plain) step
    assert not decoder.unpadded and decoder.description.startswith(("packed: int8 refused", "plain: int8 refused"))


def test_the_engine_takes_the_setting_and_says_which_step_runs(tiny_tokenizer):
    from kvrag import Engine, EngineConfig, InvalidRequestError

    model = as_dtype(make_tiny_model(608), "bfloat16")
    with Engine.from_model(model, tiny_tokenizer, weights="int8") as engine:
        decode = engine.info().decode
        assert decode.startswith(("quantized: int8", "packed: int8 refused", "plain: int8 refused"))
        assert engine.generate(prompt="Hello there, how are you?", max_new_tokens=4).stats.completion_tokens == 4
    with pytest.raises(InvalidRequestError, match="weights must be 'auto' or one of"):
        EngineConfig(weights="int3")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased Q/K/V, kept outside the cache
def test_cached_decode_weights_are_the_built_ones_and_a_damaged_file_is_built_again(family, fmt, tmp_path):
    from kvrag.engine.model.quantized import cache_file

    adapter = bf16_adapter(family)
    cache = cache_file(tmp_path, "f" * 64, fmt)
    built = Decoder(adapter, 8, weights=fmt, cache=cache)
    if not built.unpadded:
        pytest.skip(f"no {fmt} decode here: {built.description}")
    assert (
        cache.is_file()
        and built.description.startswith(f"quantized: {fmt} weight-only")
        and "quantized)" in built.description
    )
    read = Decoder(adapter, 8, weights=fmt, cache=cache)
    assert "read from the cache" in read.description
    for a, b in zip(built.weights.layers + [built.weights.lm_head], read.weights.layers + [read.weights.lm_head]):
        for part in ("qkv", "o", "gate_up", "down") if hasattr(a, "qkv") else ("",):
            x, y = (getattr(a, part), getattr(b, part)) if part else (a, b)
            assert x.tensors().keys() == y.tensors().keys()
            assert all(torch.equal(x.tensors()[k], y.tensors()[k]) for k in x.tensors())
            assert (x.bias is None) == (y.bias is None) and (x.bias is None or torch.equal(x.bias, y.bias))
    torch.manual_seed(2)
    prompts = [torch.randint(5, 500, (n,)) for n in LENGTHS]
    assert torch.equal(built.step(rows_for(adapter, prompts, 1)), read.step(rows_for(adapter, prompts, 1)))
    cache.write_bytes(b"not safetensors")
    again = Decoder(adapter, 8, weights=fmt, cache=cache)
    assert "quantized)" in again.description and cache.stat().st_size > 100  # built and kept again


def test_int4_falls_back_to_torchs_kernel_and_says_why_where_kvrags_does_not_build(monkeypatch, tmp_path):
    from kvrag.engine.model import quantized as Q

    monkeypatch.setattr(Q, "int4_kernel", lambda: (None, "no C++ compiler found"))
    adapter = bf16_adapter()
    decoder = quantized(adapter, "int4")
    assert "torch's int4 kernel: kvrag's is not built here (no C++ compiler found)" in decoder.description
    assert isinstance(decoder.weights.lm_head, Q.Int4Linear)
    assert "-int4x8-" not in Q.cache_file(tmp_path, "f" * 64, "int4").name


def test_int4_runs_kvrags_kernel_where_it_builds_and_keeps_its_own_layout_in_the_cache(tmp_path):
    from kvrag.engine.model.quantized import Int4x8Linear, cache_file
    from kvrag.kernels.int4_cpu import int4_kernel

    kernel, why = int4_kernel()
    if kernel is None:
        pytest.skip(f"kvrag's int4 kernel is not built here: {why}")
    decoder = quantized(bf16_adapter(), "int4")
    assert f"kvrag's int4×int8 kernel ({kernel.isa})" in decoder.description
    assert all(isinstance(p.gate_up, Int4x8Linear) for p in decoder.weights.layers)
    assert isinstance(decoder.weights.lm_head, Int4x8Linear)
    assert "-int4x8-" in cache_file(tmp_path, "f" * 64, "int4").name
