"""kvrag's int4 × int8 CPU kernel against the PyTorch reference of the same integer arithmetic.

Every SIMD path the build has is run (the AVX2 one forced on an AVX512-VNNI machine); where the
kernel does not build here (no compiler, no AVX2, not x86-64 Linux) these tests skip with the reason.
"""

from __future__ import annotations

import platform

import pytest
import torch

from kvrag.kernels import int4_cpu
from kvrag.kernels.int4_cpu import GROUP, int4_kernel, int4_mm_ref, pack_int4


@pytest.fixture(scope="module")
def kernel():
    built, why = int4_kernel()
    if built is None:
        pytest.skip(f"kvrag's int4 kernel is not built here: {why}")
    return built


def weights(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // GROUP, generator=gen) * 0.02 + 1e-3).half()
    lows = (-torch.rand(n, k // GROUP, generator=gen) * 0.1).half()
    return codes, pack_int4(codes), scales, lows


def assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    # float32 sums of exact integer dots: off by float rounding of sums over K / 32 groups
    bound = 1e-5 * ref.abs().amax().clamp(min=1.0)
    assert (y.double() - ref).abs().max() <= bound, ((y.double() - ref).abs().max().item(), bound.item())


# K: 32 (one group, no whole block), 96 (3: AVX512's blocks of 4 miss them all), 160, 576 (SmolLM2's
# hidden: 18 groups, 2 past the blocks), 1536; N odd, below and above the parallel grain
@pytest.mark.parametrize("k", [32, 96, 160, 576, 1536])
@pytest.mark.parametrize("n", [1, 7, 33, 130])
def test_the_kernel_equals_the_reference_for_every_row_count_and_path(kernel, n, k):
    _, packed, scales, lows = weights(n, k, seed=n * 1000 + k)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    ref = int4_mm_ref(x, packed, scales, lows)
    for isa in kernel.isas:
        for m in range(1, 17):
            assert_matches(kernel.mm(x[:m], packed, scales, lows, torch.float32, isa=isa), ref[:m])


def test_the_reference_is_the_dequantized_product_up_to_the_activations_rounding(kernel):
    codes, packed, scales, lows = weights(64, 256)
    w = (codes.reshape(64, 8, GROUP).float() * scales.float()[..., None] + lows.float()[..., None]).reshape(64, 256)
    x = torch.randn(3, 256).to(torch.bfloat16)
    exact = x.float() @ w.T
    ref = int4_mm_ref(x, packed, scales, lows).float()
    assert (ref - exact).norm() / exact.norm() < 0.01  # int8 activations: ~0.4% per group
    assert_matches(kernel.mm(x, packed, scales, lows, torch.float32), ref.double())


def test_bfloat16_output_is_the_float32_output_rounded_and_every_path_agrees(kernel):
    _, packed, scales, lows = weights(96, 512)
    x = torch.randn(5, 512).to(torch.bfloat16)
    outs = {isa: kernel.mm(x, packed, scales, lows, isa=isa) for isa in kernel.isas}
    f32 = kernel.mm(x, packed, scales, lows, torch.float32)
    for y in outs.values():
        assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), f32, rtol=2**-8, atol=1e-6)


def test_a_row_never_depends_on_the_other_rows(kernel):
    _, packed, scales, lows = weights(130, 576)
    x = torch.randn(16, 576).to(torch.bfloat16)
    for isa in kernel.isas:
        together = kernel.mm(x, packed, scales, lows, isa=isa)
        for m in range(16):
            assert torch.equal(kernel.mm(x[m : m + 1], packed, scales, lows, isa=isa)[0], together[m])
        swapped = x.clone()
        swapped[1:] = torch.randn(15, 576).to(torch.bfloat16)
        assert torch.equal(kernel.mm(swapped, packed, scales, lows, isa=isa)[0], together[0])


def test_zero_and_large_activations(kernel):
    _, packed, scales, lows = weights(40, 128)
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    x[1, :32] = 3e4  # one group of large values; the next groups zero
    x[2] = torch.linspace(-1e-3, 1e-3, 128)
    ref = int4_mm_ref(x, packed, scales, lows)
    y = kernel.mm(x, packed, scales, lows, torch.float32)
    assert torch.equal(y[0], torch.zeros(40)) and torch.isfinite(y).all()
    assert_matches(y, ref)


def test_what_the_layout_cannot_take_is_refused_with_one_clear_error(kernel):
    _, packed, scales, lows = weights(8, 64)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="whole groups of 32, got K = 48"):
        kernel.mm(torch.randn(2, 48).to(torch.bfloat16), packed, scales, lows)
    with pytest.raises(ValueError, match="codes must be a contiguous torch.uint8"):
        kernel.mm(torch.randn(2, 96).to(torch.bfloat16), packed, scales, lows)  # weights of another K
    with pytest.raises(ValueError, match="2-D bfloat16"):
        kernel.mm(x.float(), packed, scales, lows)
    with pytest.raises(ValueError, match="scales must be"):
        kernel.mm(x, packed, scales.float(), lows)
    with pytest.raises(ValueError, match="lows must be"):
        kernel.mm(x, packed, scales, lows[:4])
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        kernel.mm(x, packed, scales, lows, torch.float16)
    with pytest.raises(ValueError, match="without the 'avx9' path"):
        kernel.mm(x, packed, scales, lows, isa="avx9")
    with pytest.raises(ValueError, match="whole groups of 32, got K = 40"):
        pack_int4(torch.zeros(4, 40, dtype=torch.int32))


def test_a_build_that_fails_returns_why_and_raises_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRAG_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("the kernel is built on x86-64 Linux only")
    built, why = int4_cpu._load()
    assert built is None and why.startswith("int4_cpu.cpp did not compile (FileNotFoundError")
    assert not list((tmp_path / "kernels").iterdir())  # no half-written library left behind


def test_the_source_ships_with_the_package():
    from importlib.resources import files

    assert (
        files("kvrag.kernels").joinpath("int4_cpu.cpp").is_file()
        and files("kvrag.kernels").joinpath("bf16.h").is_file()
    )
    assert '"kvrag.kernels" = ["*.cpp", "*.h"]' in open(int4_cpu.Path(__file__).parents[2] / "pyproject.toml").read()
