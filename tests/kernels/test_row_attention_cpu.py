"""kvrag's C++ decode-row attention (kvrag/kernels/row_attention_cpu.py) against PyTorch's fused attention
(the path it replaces, :func:`kvrag.kernels.reference.one_row`) and a float64 softmax.

Skipped where the kernel cannot be built (no C++ compiler, a CPU without AVX-512F): decode rows then
keep PyTorch's fused attention, which the other tests cover."""

from __future__ import annotations

import pytest
import torch

import kvrag.kernels as K
from kvrag.kernels import reference as R
from kvrag.kernels.row_attention_cpu import row_kernel, row_supported


@pytest.fixture(scope="module")
def kernel():
    built, why = row_kernel()
    if built is None:
        pytest.skip(f"no row attention kernel here: {why}")
    return built


def rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def truth(q, k, v, scale):
    """float64 softmax attention of q [H, 1, D] over k/v [Hkv, S, D]."""
    g = q.shape[0] // k.shape[0]
    kk, vv = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    return torch.softmax(q.double() @ kk.transpose(1, 2) * scale, dim=-1) @ vv


@pytest.mark.parametrize(
    "heads,kv_heads,dim,keys",
    [(9, 3, 64, 1), (9, 3, 64, 700), (12, 2, 128, 257), (4, 2, 16, 37), (8, 1, 32, 513), (4, 4, 256, 90)],
)
def test_a_row_is_within_rounding_of_a_float64_softmax_and_no_further_than_fused_attention(
    kernel, heads, kv_heads, dim, keys
):
    """Shapes of SmolLM2 (9/3 x 64), the Qwen2.5-1.5B (12/2 x 128), the tiny test models (16, 32 wide), one
    KV head, no grouping; keys within one 256-key block and across several. Its error against a float64
    softmax is the output's rounding and at most that of PyTorch's fused attention (which also rounds the
    weights to bfloat16), plus one unit of the output."""
    buf_k, buf_v = rand(kv_heads, keys + 5, dim, seed=1), rand(kv_heads, keys + 5, dim, seed=2)
    buf_k[:, keys:], buf_v[:, keys:] = float("nan"), float("nan")  # past the row: never read
    k, v = buf_k[:, :keys], buf_v[:, :keys]  # a buffer's slice: strided heads
    q = rand(heads, 1, dim, seed=3, scale=2.0)
    scale = dim**-0.5
    want = truth(q, k, v, scale)
    got = kernel.attend(q, k, v, scale)
    fused = R.one_row(q, k, v, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    ulp = want.abs().max().item() * 2**-8  # one unit of bf16 at the outputs' size
    assert (got.double() - want).abs().max() <= (fused.double() - want).abs().max() + ulp
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


def test_a_rows_result_depends_on_its_inputs_only(kernel):
    """The same row gives the same bits alone, after other rows, with another thread count, and as a
    draft row's slice of a step's queries (a strided view)."""
    k, v = rand(3, 900, 64, seed=4), rand(3, 900, 64, seed=5)
    rows = rand(9, 4, 64, seed=6)
    alone = kernel.attend(rows[:, 2:3].contiguous(), k, v, 0.125)
    kernel.attend(rows[:, :1].contiguous(), k, v, 0.125)
    assert torch.equal(kernel.attend(rows[:, 2:3], k, v, 0.125), alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(kernel.attend(rows[:, 2:3], k, v, 0.125), alone)
    finally:
        torch.set_num_threads(threads)


def test_attention_sends_bfloat16_decode_rows_to_the_kernel_and_the_rest_to_the_reference(kernel, monkeypatch):
    """``attention`` (auto) takes the kernel for a bf16 decode row on a global layer and on a sliding-window
    layer (its last ``window`` keys); float32 rows, rows that are not the keys' last position, and the
    ``reference`` backend keep the reference's fused attention; so does a prefill's last row (not ``decode``)."""
    k, v = rand(2, 50, 16, seed=7), rand(2, 50, 16, seed=8)
    q = rand(4, 1, 16, seed=9)
    calls = []
    real = type(kernel).run
    monkeypatch.setattr(type(kernel), "run", lambda self, *a: calls.append(a[1].shape[1]) or real(self, *a))
    pos = torch.tensor([49])
    assert torch.equal(K.attention(q, pos, k, v, 0.25, span=(49, 49), decode=True), kernel.attend(q, k, v, 0.25))
    assert torch.equal(
        K.attention(q, pos, k, v, 0.25, window=9, decode=True), kernel.attend(q, k[:, 41:], v[:, 41:], 0.25)
    )
    assert calls == [50, 50, 9, 9]
    K.attention(q.float(), pos, k.float(), v.float(), 0.25, decode=True)
    K.attention(q, torch.tensor([30]), k, v, 0.25, decode=True)
    K.attention(q, pos, k, v, 0.25)  # a prefill's last row
    with K.use_backend("reference"):
        K.attention(q, pos, k, v, 0.25, decode=True)
    assert calls == [50, 50, 9, 9]


def test_shapes_the_kernel_does_not_take_are_refused_with_one_clear_error(kernel):
    q, k = rand(4, 1, 24, seed=10), rand(2, 30, 24, seed=11)  # 24 wide: not a multiple of 16
    assert not row_supported(q, k, k)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.attend(q, k, k, 0.2)
    assert not row_supported(rand(4, 1, 16, seed=1), rand(2, 0, 16, seed=1), rand(2, 0, 16, seed=1))  # no keys
    assert not row_supported(rand(34, 1, 16, seed=1), rand(2, 5, 16, seed=1), rand(2, 5, 16, seed=1))  # 17 per head
