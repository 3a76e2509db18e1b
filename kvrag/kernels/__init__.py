"""Kernels for the fusion hot spots, dispatched by device.

CUDA tensors go to the Triton kernels (``triton_rope``, ``triton_attention``, ``triton_deviation``)
when Triton is installed; a bfloat16 decode row on a CPU to kvrag's C++ row kernel where it builds
(:mod:`kvrag.kernels.row_attention_cpu`); everything else to the PyTorch references in
:mod:`kvrag.kernels.reference`. Triton is imported lazily, on the first CUDA call, and only by
this package: ``import kvrag`` works without Triton or a GPU. Top-k stays ``torch.topk`` on every
device (a Triton top-k would not beat it at these sizes).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator

import torch

from kvrag.kernels.reference import (
    QUERY_BLOCK,
    attention_ref,
    contiguous_tail,
    kv_deviation_ref,
    positions_span,
    rope_rotate_into_ref,
    rope_rotate_ref,
    signed_sin,
    topk_ref,
)
from kvrag.kernels.row_attention_cpu import row_kernel, row_supported

__all__ = [
    "rope_rotate",
    "rope_rotate_into",
    "signed_sin",
    "attention",
    "kv_deviation",
    "topk",
    "QUERY_BLOCK",
    "BACKENDS",
    "use_backend",
    "triton_available",
]

#: ``auto``: Triton for CUDA tensors when importable (attention: for rows scattered through the keys;
#: a contiguous tail, a prefill or a decode step, goes to PyTorch's fused attention); a bfloat16
#: decode row on a CPU to kvrag's row kernel where it is built (:mod:`kvrag.kernels.row_attention_cpu`);
#: else the reference; ``reference`` and ``triton`` force one path (tests and benchmarks).
BACKENDS = ("auto", "reference", "triton")

_backend = "auto"
_triton_ok: bool | None = None


def triton_available() -> bool:
    """Whether Triton can be imported here (checked once)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            _triton_ok = importlib.util.find_spec("triton") is not None
            if _triton_ok:
                importlib.import_module("triton")
        except Exception:  # a broken install counts as absent: the references still work
            _triton_ok = False
    return _triton_ok


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend inside a ``with`` block (process-wide; meant for tests and benchmarks).

    ``triton`` on CPU tensors needs Triton's interpreter (``TRITON_INTERPRET=1`` before kvrag's
    Triton modules are first imported); otherwise the kernel wrappers raise a clear error.
    """
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if name == "triton" and not triton_available():
        raise RuntimeError("the 'triton' kernel backend needs the triton package (pip install 'kvrag[test]')")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def _triton_for(x: torch.Tensor) -> bool:
    if _backend == "auto":
        return x.is_cuda and triton_available()
    return _backend == "triton"


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, D] rotated by the angles of cos/sin [T, D] (split-halves pairing)."""
    if _triton_for(x):
        from kvrag.kernels.triton_rope import rope_rotate_triton

        return rope_rotate_triton(x, cos, sin)
    return rope_rotate_ref(x, cos, sin)


def rope_rotate_into(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, signed: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[...] = rope_rotate(x, cos, sin)`` (``out`` [heads, T, D], e.g. a view of a KV buffer);
    ``signed``: :func:`~kvrag.kernels.reference.signed_sin` of ``sin``, when made once for many calls."""
    if _triton_for(x):
        return out.copy_(rope_rotate(x, cos, sin))
    return rope_rotate_into_ref(out, x, cos, sin, signed)


def attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    masks: dict | None = None,
    window: int | None = None,
    span: tuple[int, int] | None = None,
    split_tail: bool = False,
    decode: bool = False,
) -> torch.Tensor:
    """Causal attention of query rows q [H, Tq, D] at positions q_pos over k/v [Hkv, S, D].

    ``window``: a sliding-window layer's size (row at p sees keys (p - window, p]); None: global.
    ``masks``: a dict the reference path keeps the rows' attention masks in, to be passed again
    with the same ``q_pos`` and ``window`` (the Triton kernel needs none).
    ``span``: ``(q_pos[0], q_pos[-1])`` as Python ints, when the caller knows them: on a GPU, reading
    them from ``q_pos`` waits for every queued kernel (a decode step's rows know their positions).
    ``split_tail``: see :func:`~kvrag.kernels.reference.attention_ref` (a deterministic prefill's slices).
    ``decode``: a decode step's row (bfloat16, CPU): kvrag's row kernel where it is built. A prefill's
    last row keeps the reference's fused attention, whose bits are transformers' (the gate's ratio 1.0).
    """
    if _triton_for(q):
        if span is None and _backend == "auto" and window is None and q.shape[1]:
            span = positions_span(q_pos)  # read once: the dispatch needs it, the reference path takes it too
        if not (_backend == "auto" and _contiguous_tail(q_pos, q.shape[1], k.shape[1], window, span)):
            from kvrag.kernels.triton_attention import attention_triton

            return attention_triton(q, q_pos, k, v, scale, window=window, span=span)
    elif decode and _backend == "auto" and q.shape[1] == 1 and q.device.type == "cpu" and q.dtype == torch.bfloat16:
        out = _cpu_row(q, q_pos, k, v, scale, window, span)
        if out is not None:
            return out
    return attention_ref(
        q, q_pos, k, v, scale, masks=masks, window=window, span=span, split_tail=split_tail, decode=decode
    )


def _cpu_row(q, q_pos, k, v, scale: float, window: int | None, span) -> torch.Tensor | None:
    """A decode row (the keys' last position) on a CPU through kvrag's row kernel
    (:mod:`kvrag.kernels.row_attention_cpu`; a sliding-window layer's last ``window`` keys), or None
    where it does not apply or is not built here: the reference's fused attention then."""
    pos = span[0] if span is not None else int(q_pos[0])
    if pos != k.shape[1] - 1:
        return None
    if window is not None and pos >= window:  # a sliding-window layer: its last `window` keys
        k, v = k[:, pos - window + 1 :], v[:, pos - window + 1 :]
    if not row_supported(q, k, v):
        return None
    kernel, _ = row_kernel()
    return None if kernel is None else kernel.run(q, k, v, scale)


def _contiguous_tail(
    q_pos: torch.Tensor, rows: int, keys: int, window: int | None, span: tuple[int, int] | None = None
) -> bool:
    """Whether the rows are the last ``rows`` positions of the keys (a prefill or a decode step) on a
    global layer: PyTorch's fused causal attention beats the scattered-row kernel there, which wins on
    rows scattered through the keys, the blend's recompute (docs/results.md, "Kernels and the GPU")."""
    if window is not None or rows == 0:
        return False
    return contiguous_tail(*(span or positions_span(q_pos)), rows, keys)


def kv_deviation(k_new, k_old, v_new, v_old, what: str = "kv") -> torch.Tensor:
    """Per-token squared deviation [T] between fresh and cached K/V [Hkv, T, D]."""
    if _triton_for(k_new):
        from kvrag.kernels.triton_deviation import kv_deviation_triton

        return kv_deviation_triton(k_new, k_old, v_new, v_old, what)
    return kv_deviation_ref(k_new, k_old, v_new, v_old, what)


def topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest scores (``torch.topk`` on the scores' device)."""
    return topk_ref(scores, k)
