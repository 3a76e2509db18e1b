"""Triton RoPE kernel: rotation by cos/sin tables (places cached keys, stored without RoPE, at their positions).

Pairing: split halves, dimension ``i`` with ``i + D/2`` (Llama, Mistral, Qwen2, SmolLM in
transformers). Arithmetic in float32, one rounding to the tensor's dtype on store.
Reference: :func:`kvrag.kernels.reference.rope_rotate_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrag.kernels._checks import KERNEL_FLOATS, check_launchable, check_same_device, check_tensor

__all__ = ["rope_rotate_triton", "launch_config"]


# lengths change with every request: one compiled kernel for all of them (Triton specialises an
# int argument on its divisibility by 16 and on being 1, so each new pattern was a new compile)
@triton.jit(do_not_specialize=["T"])
def _rope_table_kernel(
    X,
    COS,
    SIN,
    OUT,
    sxh,
    sxt,
    sxd,
    sct,
    scd,
    sst,
    ssd,
    soh,
    sot,
    sod,
    T,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_H)
    mask = (t < T)[:, None] & (j < HALF)[None, :]
    t64 = t.to(tl.int64)[:, None]
    j1 = j[None, :]
    j2 = j1 + HALF
    xp = X + head * sxh + t64 * sxt
    x1 = tl.load(xp + j1 * sxd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + j2 * sxd, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + t64 * sct + j1 * scd, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t64 * sct + j2 * scd, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t64 * sst + j1 * ssd, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t64 * sst + j2 * ssd, mask=mask, other=0.0).to(tl.float32)
    op = OUT + head * soh + t64 * sot
    tl.store(op + j1 * sod, (x1 * c1 - x2 * s1).to(OUT.dtype.element_ty), mask=mask)
    tl.store(op + j2 * sod, (x2 * c2 + x1 * s2).to(OUT.dtype.element_ty), mask=mask)


def launch_config(t: int, half: int) -> dict:
    """Blocks of tokens x half head dims, up to 4096 pairs per program."""
    block_h = max(triton.next_power_of_2(half), 1)
    block_t = max(1, min(64, 4096 // block_h, triton.next_power_of_2(max(t, 1))))
    return dict(BLOCK_T=block_t, BLOCK_H=block_h)


def _check_x(name: str, x) -> tuple[int, int, int]:
    check_tensor(name, x, 3, KERNEL_FLOATS)
    h, t, d = x.shape
    if d % 2:
        raise ValueError(f"{name} head dim must be even for RoPE, got {d}")
    return h, t, d


def rope_rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`~kvrag.kernels.reference.rope_rotate_ref` (any strides; new output).

    Args:
        x: [heads, T, D] float16/bfloat16/float32.
        cos, sin: [T, D] float tables (both halves read, as the reference does).

    Returns:
        [heads, T, D] contiguous, dtype of ``x``.
    """
    h, t, d = _check_x("x", x)
    for name, tab in (("cos", cos), ("sin", sin)):
        check_tensor(name, tab, 2, KERNEL_FLOATS)
        if tuple(tab.shape) != (t, d):
            raise ValueError(f"{name} must have shape {(t, d)} to match x {tuple(x.shape)}, got {tuple(tab.shape)}")
    device = check_same_device(x=x, cos=cos, sin=sin)
    check_launchable(device, _rope_table_kernel)
    out = torch.empty((h, t, d), dtype=x.dtype, device=device)
    if out.numel() == 0:
        return out
    cfg = launch_config(t, d // 2)
    _rope_table_kernel[(triton.cdiv(t, cfg["BLOCK_T"]), h)](
        x,
        cos,
        sin,
        out,
        *x.stride(),
        *cos.stride(),
        *sin.stride(),
        *out.stride(),
        t,
        HALF=d // 2,
        **cfg,
    )
    return out
