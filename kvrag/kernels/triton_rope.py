"""Triton RoPE kernels: rotation by cos/sin tables, and in-place re-rotation of keys between positions.

Pairing: split halves, dimension ``i`` with ``i + D/2`` (Llama, Mistral, Qwen2, SmolLM in
transformers). Arithmetic in float32, one rounding to the tensor's dtype on store.
References: :func:`kvrag.kernels.reference.rope_rotate_ref` and
:func:`kvrag.kernels.reference.rope_rerotate_ref_`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrag.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_launchable,
    check_same_device,
    check_tensor,
    check_writable,
)

__all__ = ["rope_rotate_triton", "rope_rerotate_triton_", "launch_config", "REDUCTION"]

# 2*pi split for Cody-Waite range reduction: C1 has 8 significant bits, so k * C1 is exact in
# float32 for |k| < 2**16 (angles up to ~400k radians); C2 carries the rest.
_TWO_PI_C1 = 6.28125
_TWO_PI_C2 = 0.0019353071795864769
_INV_TWO_PI = 0.15915494309189535
REDUCTION = dict(C1=_TWO_PI_C1, C2=_TWO_PI_C2, INV_TWO_PI=_INV_TWO_PI)


@triton.jit
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


@triton.jit
def _rope_rerotate_kernel(
    X,
    OLD,
    NEW,
    INV_FREQ,
    sxh,
    sxt,
    sxd,
    s_old,
    s_new,
    s_inv,
    T,
    scaling,
    HAS_OLD: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    C1: tl.constexpr,
    C2: tl.constexpr,
    INV_TWO_PI: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_H)
    t_ok = t < T
    mask = t_ok[:, None] & (j < HALF)[None, :]
    delta = tl.load(NEW + t * s_new, mask=t_ok, other=0).to(tl.int64)
    if HAS_OLD:
        delta -= tl.load(OLD + t * s_old, mask=t_ok, other=0).to(tl.int64)
    # The angle exactly as the reference forms it (float32 position times float32 frequency),
    # then reduced to [-pi, pi] so cos/sin stay accurate whatever their hardware lowering.
    inv = tl.load(INV_FREQ + j * s_inv, mask=j < HALF, other=0.0).to(tl.float32)
    angle = delta.to(tl.float32)[:, None] * inv[None, :]
    k = tl.floor(angle * INV_TWO_PI + 0.5)
    r = (angle - k * C1) - k * C2
    cos = tl.cos(r) * scaling
    sin = tl.sin(r) * scaling
    t64 = t.to(tl.int64)[:, None]
    p1 = X + head * sxh + t64 * sxt + j[None, :] * sxd
    p2 = p1 + HALF * sxd
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


def launch_config(t: int, half: int) -> dict:
    """Blocks of tokens x half head dims, up to 4096 pairs per program."""
    block_h = max(triton.next_power_of_2(half), 1)
    block_t = max(1, min(64, 4096 // block_h, triton.next_power_of_2(max(t, 1))))
    return dict(BLOCK_T=block_t, BLOCK_H=block_h)


def _check_x(name: str, x) -> tuple[int, int, int]:
    check_tensor(name, x, 3, FLOAT_DTYPES)
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
        check_tensor(name, tab, 2, FLOAT_DTYPES)
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


def rope_rerotate_triton_(
    k: torch.Tensor,
    old_pos: torch.Tensor | None,
    new_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Triton version of :func:`~kvrag.kernels.reference.rope_rerotate_ref_`: rotates ``k`` in place.

    Args:
        k: [heads, T, D] keys (any non-overlapping strides), rotated in place.
        old_pos: [T] int positions the keys carry now, or None for keys stored without RoPE.
        new_pos: [T] int positions to move them to.
        inv_freq: [D/2] float inverse frequencies of the model's rotary embedding.
        scaling: factor on cos/sin (the model's attention scaling for keys without RoPE; 1.0 to
            move keys that already carry it).

    Returns:
        ``k``.
    """
    h, t, d = _check_x("k", k)
    check_writable("k", k)
    check_tensor("new_pos", new_pos, 1, INDEX_DTYPES)
    tensors = {"k": k, "new_pos": new_pos, "inv_freq": inv_freq}
    if old_pos is not None:
        check_tensor("old_pos", old_pos, 1, INDEX_DTYPES)
        tensors["old_pos"] = old_pos
    for name in ("new_pos", "old_pos"):
        if name in tensors and tensors[name].shape[0] != t:
            raise ValueError(f"{name} must have {t} entries (one per key), got {tensors[name].shape[0]}")
    check_tensor("inv_freq", inv_freq, 1, FLOAT_DTYPES)
    if inv_freq.shape[0] != d // 2:
        raise ValueError(f"inv_freq must have D/2 = {d // 2} entries, got {inv_freq.shape[0]}")
    device = check_same_device(**tensors)
    check_launchable(device, _rope_rerotate_kernel)
    if k.numel() == 0:
        return k
    cfg = launch_config(t, d // 2)
    _rope_rerotate_kernel[(triton.cdiv(t, cfg["BLOCK_T"]), h)](
        k,
        old_pos if old_pos is not None else new_pos,
        new_pos,
        inv_freq,
        *k.stride(),
        (old_pos if old_pos is not None else new_pos).stride(0),
        new_pos.stride(0),
        inv_freq.stride(0),
        t,
        float(scaling),
        HAS_OLD=old_pos is not None,
        HALF=d // 2,
        **cfg,
        **REDUCTION,
    )
    return k
