"""Triton per-token KV deviation: squared L2 distance between fresh and cached K and/or V.

One program per block of tokens sums ``(new - old)**2`` over heads and head dims in float32.
The top-k selection that follows stays ``torch.topk`` on the device (see
:func:`kvrag.kernels.topk`): it is one tuned library kernel over a few thousand scores, where a
hand-written Triton top-k would not pay for itself.
Reference: :func:`kvrag.kernels.reference.kv_deviation_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrag.kernels._checks import KERNEL_FLOATS, check_launchable, check_same_device, check_tensor

__all__ = ["kv_deviation_triton", "launch_config"]


@triton.jit
def _sq_dist(new_ptrs, old_ptrs, mask):
    a = tl.load(new_ptrs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(old_ptrs, mask=mask, other=0.0).to(tl.float32)
    diff = a - b
    return tl.sum(diff * diff, axis=1)


# lengths change with every request: one compiled kernel for all of them (Triton specialises an
# int argument on its divisibility by 16 and on being 1, so each new pattern was a new compile)
@triton.jit(do_not_specialize=["T"])
def _deviation_kernel(
    KN,
    KO,
    VN,
    VO,
    OUT,
    skn_h,
    skn_t,
    skn_d,
    sko_h,
    sko_t,
    sko_d,
    svn_h,
    svn_t,
    svn_d,
    svo_h,
    svo_t,
    svo_d,
    T,
    HEADS,
    HEAD_DIM: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    mask = t_ok[:, None] & (dims < HEAD_DIM)[None, :]
    # [BLOCK_T, BLOCK_D] pointers of head 0, moved one head on per step (64-bit pointer arithmetic)
    kn = KN + t64[:, None] * skn_t + dims[None, :] * skn_d
    ko = KO + t64[:, None] * sko_t + dims[None, :] * sko_d
    vn = VN + t64[:, None] * svn_t + dims[None, :] * svn_d
    vo = VO + t64[:, None] * svo_t + dims[None, :] * svo_d
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for _ in range(0, HEADS):
        if HAS_K:
            acc += _sq_dist(kn, ko, mask)
        if HAS_V:
            acc += _sq_dist(vn, vo, mask)
        kn += skn_h
        ko += sko_h
        vn += svn_h
        vo += svo_h
    tl.store(OUT + t, acc, mask=t_ok)


def launch_config(n: int, d: int) -> dict:
    """Blocks of tokens x the whole head dim, up to 4096 elements per load."""
    block_d = triton.next_power_of_2(d)
    return dict(BLOCK_T=max(1, min(64, 4096 // block_d, triton.next_power_of_2(max(n, 1)))), BLOCK_D=block_d)


def kv_deviation_triton(
    k_new: torch.Tensor, k_old: torch.Tensor, v_new: torch.Tensor, v_old: torch.Tensor, what: str = "kv"
) -> torch.Tensor:
    """Triton version of :func:`~kvrag.kernels.reference.kv_deviation_ref` (any strides).

    Args:
        k_new, k_old, v_new, v_old: [Hkv, T, D]; only the pair(s) named by ``what`` are read.
        what: ``k``, ``v`` or ``kv`` (the sum of both).

    Returns:
        [T] float32.
    """
    if what not in ("k", "v", "kv"):
        raise ValueError(f"unknown deviation {what!r}; expected 'k', 'v' or 'kv'")
    pairs = {}
    if "k" in what:
        pairs.update(k_new=k_new, k_old=k_old)
    if "v" in what:
        pairs.update(v_new=v_new, v_old=v_old)
    for label, t in pairs.items():
        check_tensor(label, t, 3, KERNEL_FLOATS)
    shape = tuple(next(iter(pairs.values())).shape)
    for t in pairs.values():
        if tuple(t.shape) != shape:
            listed = ", ".join(f"{n} {tuple(x.shape)}" for n, x in pairs.items())
            raise ValueError(f"deviation inputs must share one shape [Hkv, T, D], got {listed}")
    heads, n, d = shape
    if d > 512:
        raise ValueError(f"head dim {d} > 512 is not supported by the Triton deviation kernel")
    device = check_same_device(**pairs)
    check_launchable(device, _deviation_kernel)
    out = torch.empty(n, dtype=torch.float32, device=device)
    if n == 0:
        return out
    if heads == 0 or d == 0:
        return out.zero_()
    cfg = launch_config(n, d)
    kn, ko = pairs.get("k_new"), pairs.get("k_old")
    vn, vo = pairs.get("v_new"), pairs.get("v_old")
    # A missing pair is never read (constexpr branch); pass the present one in its place.
    kn, ko = (kn, ko) if kn is not None else (vn, vo)
    vn, vo = (vn, vo) if vn is not None else (kn, ko)
    _deviation_kernel[(triton.cdiv(n, cfg["BLOCK_T"]),)](
        kn,
        ko,
        vn,
        vo,
        out,
        *kn.stride(),
        *ko.stride(),
        *vn.stride(),
        *vo.stride(),
        n,
        heads,
        HEAD_DIM=d,
        HAS_K="k" in what,
        HAS_V="v" in what,
        **cfg,
    )
    return out
