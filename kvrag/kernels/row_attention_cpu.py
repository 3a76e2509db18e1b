"""A decode row's attention over its sequence's bfloat16 KV on a CPU (``row_attention_cpu.cpp``).

One query row q [H, 1, D] over keys and values [Hkv, S, D] (read in place, a KV buffer's slice):
float32 scores of the bf16 products (each key read once for the G = H / Hkv query heads that share
it), torch's float32 softmax, float32 weighted sums of the values rounded once to bfloat16. The
same arithmetic as PyTorch's fused attention (:func:`~kvrag.kernels.reference.one_row`) without
its bfloat16 rounding of the weights, in well under half its time on a decode row (its fixed
costs per block of keys dominate there; measured in docs/journal/real-models.md). A row's result
depends on its own inputs only: not on other rows, nor on the thread count.

The library is built at first use (:func:`kvrag.kernels.native.load_library`); where it cannot be
(no compiler, a CPU without AVX-512F), :func:`row_kernel` says why and decode rows keep PyTorch's
fused attention.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrag.kernels.native import load_library, load_once

__all__ = ["RowKernel", "row_kernel", "row_supported"]

_SOURCE = Path(__file__).with_name("row_attention_cpu.cpp")

#: The kernel's limits: query heads per KV head, and the head width (a multiple of 16).
MAX_GROUPS, MAX_DIM = 16, 256


@dataclass(frozen=True)
class RowKernel:
    """The built kernel; :meth:`attend` runs it."""

    lib: ctypes.CDLL

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [H, 1, D] over k/v [Hkv, S, D] (bfloat16 CPU tensors, last dimension contiguous, S ≥ 1,
        :func:`row_supported`): [H, 1, D] bfloat16. Raises ValueError on anything else."""
        if not row_supported(q, k, v):
            raise ValueError(
                "the row kernel takes q [H, 1, D] and k/v [Hkv, S, D] as bfloat16 CPU tensors with D a multiple "
                f"of 16 up to {MAX_DIM}, H / Hkv up to {MAX_GROUPS}, S >= 1, the last dimension contiguous; got "
                f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}"
            )
        return self.run(q, k, v, scale)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """:meth:`attend` without the check, for tensors :func:`row_supported` has passed (a decode
        step calls it per row and layer, after the dispatch checked)."""
        heads, d = q.shape[0], q.shape[2]
        kv_heads, s = k.shape[0], k.shape[1]
        groups = heads // kv_heads
        q = q.contiguous()
        scores = torch.empty(kv_heads, groups, s)
        rc = self.lib.kvrag_row_scores(
            q.data_ptr(), k.data_ptr(), k.stride(0), k.stride(1), kv_heads, groups, s, d, scale, scores.data_ptr()
        )
        if rc == 0:
            weights = torch.softmax(scores, dim=-1)
            out = torch.empty(heads, 1, d, dtype=q.dtype)
            rc = self.lib.kvrag_row_values(
                weights.data_ptr(), v.data_ptr(), v.stride(0), v.stride(1), kv_heads, groups, s, d, out.data_ptr()
            )
        if rc != 0:  # row_supported refuses these first; a mismatch between the two is a bug here
            raise RuntimeError(f"kvrag's row attention kernel refused the call (code {rc})")
        return out


def row_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :meth:`RowKernel.attend` takes these tensors."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[1] != 1:
        return False
    heads, d = q.shape[0], q.shape[2]
    kv_heads, s, kd = k.shape
    return (
        all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in (q, k, v))
        and kd == d
        and d % 16 == 0
        and 0 < d <= MAX_DIM
        and kv_heads > 0
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUPS
        and s >= 1
        and k.stride(2) == 1
        and v.stride(2) == 1
    )


def row_kernel() -> tuple[RowKernel | None, str]:
    """The kernel (built and loaded once per process), or None and why it is not there."""
    return load_once(_SOURCE, _load)


def _load() -> tuple[RowKernel | None, str]:
    lib, why = load_library(_SOURCE)
    if lib is None:
        return None, why
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvrag_row_scores.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr]
    lib.kvrag_row_values.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, ptr]
    lib.kvrag_row_scores.restype = lib.kvrag_row_values.restype = ctypes.c_int
    return RowKernel(lib), "kvrag's row attention kernel (AVX-512)"
