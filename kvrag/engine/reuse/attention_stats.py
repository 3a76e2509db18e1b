"""Cache-Craft's attention statistics of a chunk, measured where its KV is computed (§2.3, §3.2).

When a chunk's KV is computed behind some context, how much its tokens attend to that context
(inter-attention) and to themselves (intra-attention) says how much the KV depends on the context:

- ``a_l = sum_j inter_l(C_j, C) / (|C| |C_j|)`` and ``b_l = intra_l(C) / |C|^2`` per layer ``l``, over
  the context chunks ``C_j``; ``CCI = sigmoid(mean_l a_l / mean_l b_l)`` (the cache context impact);
- the share of the inter-attention each context chunk gets (Cache-Craft's ``inter(i, j)`` in beta);
- each block's inter-attention (the tokens most shaped by the context: Cache-Craft recomputes the
  top ones by this ranking).

Measuring every query of every layer would cost as much as the attention itself; a :class:`Tap`
keeps the queries of one token per ``stride``-token block (the probe's sample) as a forward pass
computes them, and :func:`chunk_statistics` turns them into the figures above once the pass has
filled the KV buffer. Attention is over heads and the causal keys, softmax in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvrag.engine.model.runner import KVBuffer

__all__ = ["STATS_STRIDE", "Tap", "ContextSpan", "ChunkStatistics", "chunk_statistics", "block_middles"]

#: One query in this many tokens of a chunk is sampled for its attention statistics.
STATS_STRIDE = 16


def block_middles(start: int, end: int, stride: int) -> list[int]:
    """The middle position of every ``stride``-token block of [start, end)."""
    return [a + (min(a + stride, end) - a) // 2 for a in range(start, end, stride)]


class Tap:
    """Keeps the queries (with RoPE) of ``positions`` on every layer, as forward passes compute them.

    Args:
        positions: the positions observed, increasing.
        n_layers: the model's layers.
    """

    def __init__(self, positions: list[int], n_layers: int) -> None:
        self.positions = torch.tensor(positions, dtype=torch.long)
        self.q: list[torch.Tensor | None] = [None] * n_layers  # per layer [H, S, D]
        self._on: dict = {}  # device -> positions there

    def observe(self, layer: int, pos: torch.Tensor, q: torch.Tensor) -> None:
        # a few small tensor ops per layer, no Python loop over the rows: it runs inside every prefill
        # that writes a chunk back, including the full prefill of a request with nothing cached
        if not self.positions.numel() or not pos.numel():
            return
        positions = self._on.get(pos.device)
        if positions is None:
            positions = self._on[pos.device] = self.positions.to(pos.device)
        rows = torch.searchsorted(pos, positions).clamp_(max=pos.numel() - 1)  # [S]: pos is increasing
        seen = pos[rows] == positions  # [S]
        if not bool(seen.any()):
            return
        if self.q[layer] is None:
            self.q[layer] = q.new_zeros((q.shape[0], positions.numel(), q.shape[2]))
        self.q[layer][:, seen] = q[:, rows[seen]]

    def complete(self) -> bool:
        return all(q is not None for q in self.q)


@dataclass(frozen=True, slots=True)
class ContextSpan:
    """A chunk in the context a measured chunk was computed behind: positions [start, end) and its
    content id (what the chunk's variant names as its context)."""

    start: int
    end: int
    id: str


@dataclass(frozen=True, slots=True)
class ChunkStatistics:
    """What :func:`chunk_statistics` measured of one chunk.

    Attributes:
        cci: Cache-Craft's cache context impact in (0, 1).
        weights: each context chunk's share of the chunk's inter-attention (sums to 1; empty
            without context chunks), in the order of the ``context`` spans given.
        block_inter: [B] each block's attention to the context chunks (its sampled query's, summed over
            layers and heads): high means shaped by the context.
    """

    cci: float
    weights: tuple[float, ...]
    block_inter: torch.Tensor


def chunk_statistics(
    tap: Tap,
    buf: KVBuffer,
    chunk: tuple[int, int],
    context: list[ContextSpan],
    scale: float,
    stride: int,
    windows: list[int | None] | None = None,
) -> ChunkStatistics | None:
    """Cache-Craft's statistics of the chunk at positions ``chunk`` behind the ``context`` spans.

    ``tap`` must have observed the chunk's block middles (:func:`block_middles`) on every layer and
    ``buf`` hold the KV of every position up to the chunk's end; ``windows`` are the layers'
    attention windows (a query at p sees keys (p - w, p] on a sliding-window layer). ``None`` if
    the tap missed a layer.
    """
    start, end = chunk
    middles = block_middles(start, end, stride)
    slots = [i for i, p in enumerate(tap.positions.tolist()) if start <= p < end]
    if len(slots) != len(middles) or not tap.complete():
        return None
    size = end - start
    device = buf.k.device
    qpos = torch.tensor(middles, device=device)
    keys = torch.arange(end, device=device)
    causal = keys[None, :] <= qpos[:, None]  # [S, K]
    inter_layers, intra_layers = [], []
    per_span = torch.zeros(len(context), device=device)
    per_block = torch.zeros(len(middles), device=device)
    for layer, q in enumerate(tap.q):
        q = q[:, slots].float()  # [H, S, D]
        k = buf.k[layer, :, :end].float()  # [Hkv, K, D]
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, S, K]
        window = windows[layer] if windows else None
        seen = causal if window is None else causal & (keys[None, :] > qpos[:, None] - window)
        weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).mean(dim=0)  # [S, K]
        span_mass = torch.stack([weights[:, s.start : s.end].sum(dim=1) for s in context], dim=1) if context else None
        intra = weights[:, start:end].sum(dim=1)  # [S]
        # sums over the chunk's queries, estimated from one query per block
        per_query = size / len(middles)
        if span_mass is not None:
            per_span += span_mass.sum(dim=0) * per_query
            per_block += span_mass.sum(dim=1)
            inter_layers.append(
                sum(
                    float(span_mass[:, j].sum()) * per_query / (size * (s.end - s.start)) for j, s in enumerate(context)
                )
            )
        else:
            inter_layers.append(0.0)
        intra_layers.append(float(intra.sum()) * per_query / (size * size))
    a, b = sum(inter_layers) / len(inter_layers), sum(intra_layers) / len(intra_layers)
    cci = 1.0 / (1.0 + math.exp(-a / b)) if b > 0 else 1.0
    total = float(per_span.sum())
    shares = tuple(float(x) / total for x in per_span) if total > 0 else tuple(1.0 / len(context) for _ in context)
    return ChunkStatistics(cci, shares, per_block.to("cpu", torch.float16))  # kept with the record: on the CPU
