"""Triton attention of a subset of query rows, at explicit positions, over the full KV sequence.

Flash-attention style forward (online softmax in float32, exp2): one program per block of query
rows and query head; it walks the keys from 0 up to the largest position in its block, masking
each row to keys ``<= its position`` (and, on a sliding-window layer, ``> its position - window``:
the walk then starts at the block's first visible key, so a block reads at most ``window +
BLOCK_M`` keys). Grouped-query heads read their shared KV head directly
(head ``h`` uses KV head ``h // (H // Hkv)``, as transformers' ``repeat_kv``). Rows need not be
contiguous; the loop bound comes from the block's own positions, so no ordering is assumed.
Reference: :func:`kvrag.kernels.reference.attention_ref`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvrag.kernels._checks import INDEX_DTYPES, KERNEL_FLOATS, check_launchable, check_same_device, check_tensor

__all__ = ["attention_triton", "launch_config"]

_LOG2E = 1.4426950408889634


# lengths change with every request: one compiled kernel for all of them (Triton specialises an
# int argument on its divisibility by 16 and on being 1, so each new pattern was a new compile)
@triton.jit(do_not_specialize=["n_rows", "seq_len", "window"])
def _attention_kernel(
    Q,
    K,
    V,
    O,  # noqa: E741 - the output pointer, named as in the paper
    POS,
    sqh,
    sqt,
    sqd,
    skh,
    skt,
    skd,
    svh,
    svt,
    svd,
    soh,
    sot,
    sod,
    spos,
    n_rows,
    seq_len,
    group,
    qk_scale,
    window,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    head = tl.program_id(1)
    kv_head = (head // group).to(tl.int64)
    head = head.to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    pos = tl.load(POS + rows * spos, mask=row_ok, other=-1).to(tl.int64)  # padding rows see nothing
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    rows64 = rows.to(tl.int64)
    q = tl.load(
        Q + head * sqh + rows64[:, None] * sqt + dims[None, :] * sqd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    hi = tl.minimum(tl.max(pos, axis=0) + 1, seq_len).to(tl.int32)  # keys this block can see
    # with a window, the walk starts at the first key the block's lowest row sees (a key block's start)
    lowest = tl.min(tl.where(row_ok, pos, hi), axis=0)
    lo = tl.where(window > 0, tl.maximum(lowest - window + 1, 0) // BLOCK_N * BLOCK_N, 0).to(tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + kv_head * skh
    v_base = V + kv_head * svh
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        cols64 = cols.to(tl.int64)
        kt = tl.load(  # [BLOCK_D, BLOCK_N]: K transposed by addressing
            k_base + cols64[None, :] * skt + dims[:, None] * skd,
            mask=col_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        visible = (cols64[None, :] <= pos[:, None]) & col_ok[None, :]
        visible = visible & ((window <= 0) | (cols64[None, :] > pos[:, None] - window))
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_base + cols64[:, None] * svt + dims[None, :] * svd,
            mask=col_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        O + head * soh + rows64[:, None] * sot + dims[None, :] * sod,
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def launch_config(tq: int, d: int, dtype: torch.dtype) -> dict:
    """Default blocks: shared memory stays under 64 KB (sm_75) at head dims up to 128, even in float32."""
    block_d = max(16, triton.next_power_of_2(d))
    block_m = 64 if tq >= 64 else max(16, triton.next_power_of_2(tq))
    block_n = 64 if block_d <= 64 else 32
    if dtype == torch.float32:
        block_m, block_n = min(block_m, 32), 32
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)


def _check(q, q_pos, k, v) -> tuple[int, int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3, KERNEL_FLOATS)
    check_tensor("q_pos", q_pos, 1, INDEX_DTYPES)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    h, tq, d = q.shape
    hkv, s, dk = k.shape
    if tuple(v.shape) != (hkv, s, dk):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if dk != d:
        raise ValueError(f"q head dim {d} differs from k head dim {dk}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    if q_pos.shape[0] != tq:
        raise ValueError(f"q_pos must have one position per query row ({tq}), got {q_pos.shape[0]}")
    if d > 256:
        raise ValueError(f"head dim {d} > 256 is not supported by the Triton attention kernel")
    return h, tq, d, hkv, s


def attention_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: int | None = None,
    span: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Triton version of :func:`~kvrag.kernels.reference.attention_ref` (any strides).

    Args:
        q: [H, Tq, D] queries (RoPE applied).
        q_pos: [Tq] int positions of the rows, each in [0, S).
        k: [Hkv, S, D] keys of positions 0..S-1 (RoPE applied); H a multiple of Hkv.
        v: [Hkv, S, D] values.
        scale: softmax scale.
        block_m, block_n, num_warps, num_stages: launch tuning (powers of two >= 16 for blocks);
            defaults suit head dims 64-128.
        window: sliding-window size (row i sees keys (q_pos[i] - window, q_pos[i]]); None: global.
        span: the rows' first and last position as Python ints, when the caller knows them (else
            read from ``q_pos``: one wait for the device).

    Returns:
        [H, Tq, D] contiguous, dtype of ``q``; row i attends to keys 0..q_pos[i] (the last
        ``window`` of them with a window).
    """
    h, tq, d, hkv, s = _check(q, q_pos, k, v)
    if window is not None and (type(window) is not int or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    device = check_same_device(q=q, q_pos=q_pos, k=k, v=v)
    check_launchable(device, _attention_kernel)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    out = torch.empty((h, tq, d), dtype=q.dtype, device=device)
    if tq == 0 or h == 0 or d == 0:
        return out
    if span is None:
        lo, hi = (int(x) for x in torch.aminmax(q_pos))  # one host sync
    else:
        lo, hi = span  # rows increase: the first is the least
    # a position outside [0, S) is a caller bug
    if lo < 0 or hi >= s:
        raise ValueError(f"query positions must lie in [0, {s}) (the KV length), got [{lo}, {hi}]")
    cfg = launch_config(tq, d, q.dtype)
    if block_m is not None:
        cfg["BLOCK_M"] = block_m
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    if num_warps is not None:
        cfg["num_warps"] = num_warps
    if num_stages is not None:
        cfg["num_stages"] = num_stages
    _attention_kernel[(triton.cdiv(tq, cfg["BLOCK_M"]), h)](
        q,
        k,
        v,
        out,
        q_pos,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        q_pos.stride(0),
        tq,
        s,
        h // hkv,
        float(scale) * _LOG2E,
        window or 0,
        HEAD_DIM=d,
        # Triton's interpreter multiplies bfloat16 bit patterns in tl.dot; on CPU tensors (only the
        # interpreter runs those) bfloat16 goes through float32. GPUs use bfloat16 tensor cores.
        UPCAST=device.type == "cpu" and q.dtype == torch.bfloat16,
        IEEE=q.dtype == torch.float32,  # float32 stays exact (no TF32) to match the reference
        **cfg,
    )
    return out
