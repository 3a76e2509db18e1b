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
import torch.nn.functional as F

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
        # (buffer id, scale, windows) -> (key ranges, per layer [S, U] attention masses): measured once
        # per pass by chunk_statistics, shared by the pass's chunks
        self.masses: dict = {}
        # the rows of the pass last observed (its positions tensor) and where the observed positions are among them
        self._rows: torch.Tensor | None = None
        self._match: tuple[torch.Tensor, torch.Tensor] | None = None

    def observe(self, layer: int, pos: torch.Tensor, q: torch.Tensor) -> None:
        # a few small tensor ops per layer, no Python loop over the rows: it runs inside every prefill
        # that writes a chunk back, including the full prefill of a request with nothing cached
        if not self.positions.numel() or not pos.numel():
            return
        if self._rows is not pos:  # a pass's layers share its rows until a selector drops some: match once
            positions = self.positions_on(pos.device)
            rows = torch.searchsorted(pos, positions).clamp_(max=pos.numel() - 1)  # [S]: pos is increasing
            where = (pos[rows] == positions).nonzero().squeeze(1)  # the observed positions among the rows
            self._rows, self._match = pos, ((where, rows[where]) if where.numel() else None)  # one read: the count
        if self._match is None:
            return
        where, rows = self._match
        if self.q[layer] is None and where.numel() == self.positions.numel():  # all here (one pass): one gather
            rows_first = q.transpose(0, 1)  # the projection's token-major rows, when q is a view of them
            # whole rows gathered (a 1,193-token pass's 74 rows: ~2 ms less over 30 layers than per head)
            self.q[layer] = (
                rows_first.index_select(0, rows).transpose(0, 1)
                if rows_first.is_contiguous()
                else q.index_select(1, rows)
            )
            return
        if self.q[layer] is None:
            self.q[layer] = q.new_zeros((q.shape[0], self.positions.numel(), q.shape[2]))
        self.q[layer][:, where] = q[:, rows]

    def positions_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`positions` on ``device`` (copied there once)."""
        positions = self._on.get(device)
        if positions is None:
            positions = self._on[device] = self.positions.to(device)
        return positions

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


#: Sampled queries measured together (one attention call each, over the keys the last one sees).
QUERY_GROUP = 64


def _span_masses(
    tap: Tap, buf: KVBuffer, ranges: tuple[tuple[int, int], ...], scale: float, windows
) -> list[torch.Tensor]:
    """Per layer [S, U]: the attention each of the tap's sampled queries pays each key range of
    ``ranges`` (softmax over its causal keys, averaged over heads).

    The masses are an attention's output whose values are the ranges' indicator vectors
    (``softmax(q K^T) @ 1[k in range]``), so PyTorch's fused attention computes them without
    materialising the weights; the samples go in groups of :data:`QUERY_GROUP`, each over the keys
    up to its last position (the causal triangle, not the square).
    """
    device, dtype = buf.k.device, buf.k.dtype
    n_kv, head_dim = buf.k.shape[1], buf.k.shape[3]
    qpos = tap.positions_on(device)
    n_keys = int(tap.positions.max()) + 1
    width = max(head_dim, len(ranges))  # the fused kernels want the values' width = the keys'
    values = torch.zeros(n_keys, width, dtype=dtype, device=device)
    for u, (a, b) in enumerate(ranges):
        values[a:b, u] = 1
    values = values.expand(1, n_kv, n_keys, width)
    keys = torch.arange(n_keys, device=device)
    groups = [(g, min(g + QUERY_GROUP, len(qpos))) for g in range(0, len(qpos), QUERY_GROUP)]
    masks: dict[int | None, list[torch.Tensor]] = {}  # attention window -> each group's mask [s, end]
    for window in set(windows or [None]):
        masks[window] = []
        for g0, g1 in groups:
            end = int(tap.positions[g1 - 1]) + 1
            seen = keys[None, :end] <= qpos[g0:g1, None]
            if window is not None:
                seen &= keys[None, :end] > qpos[g0:g1, None] - window
            masks[window].append(seen)
    out = []
    for layer, q in enumerate(tap.q):
        q = q.to(dtype)[None]  # [1, H, S, D]
        rows = []
        for (g0, g1), seen in zip(groups, masks[windows[layer] if windows else None]):
            end = seen.shape[1]
            o = F.scaled_dot_product_attention(
                q[:, :, g0:g1],
                buf.k[layer, None, :, :end],
                values[:, :, :end],
                attn_mask=seen,
                scale=scale,
                enable_gqa=True,
            )  # [1, H, s, width]
            rows.append(o[0, :, :, : len(ranges)].float().mean(dim=0))
        out.append(torch.cat(rows).cpu())  # [S, U]
    return out


def chunk_statistics(
    tap: Tap,
    buf: KVBuffer,
    chunk: tuple[int, int],
    context: list[ContextSpan],
    scale: float,
    stride: int,
    windows: list[int | None] | None = None,
    ranges: list[tuple[int, int]] | None = None,
) -> ChunkStatistics | None:
    """Cache-Craft's statistics of the chunk at positions ``chunk`` behind the ``context`` spans.

    ``tap`` must have observed the chunk's block middles (:func:`block_middles`) on every layer and
    ``buf`` hold the KV of every position the tap observed; ``windows`` are the layers' attention
    windows (a query at p sees keys (p - w, p] on a sliding-window layer). ``None`` if the tap
    missed a layer.

    The attention of all the tap's samples is measured once per ``buf`` and kept on the tap, so
    the chunks of one pass share it: ``ranges`` names every key range the pass's chunks will ask
    about (their own spans and their contexts'), so that the first call measures them all.
    """
    start, end = chunk
    middles = block_middles(start, end, stride)
    slots = [i for i, p in enumerate(tap.positions.tolist()) if start <= p < end]
    if len(slots) != len(middles) or not tap.complete():
        return None
    needed = [(s.start, s.end) for s in context] + [chunk]
    key = (id(buf), scale, tuple(windows) if windows else None)
    cached = tap.masses.get(key)
    if cached is None or any(r not in cached[0] for r in needed):
        wanted = dict.fromkeys([*(cached[0] if cached else ()), *(ranges or ()), *needed])
        cached = tap.masses[key] = (tuple(wanted), _span_masses(tap, buf, tuple(wanted), scale, windows))
    columns = {r: u for u, r in enumerate(cached[0])}
    ctx = torch.tensor([columns[(s.start, s.end)] for s in context], dtype=torch.long)
    own = columns[chunk]
    size = end - start
    per_query = size / len(middles)  # sums over the chunk's queries, estimated from one query per block
    rows = torch.tensor(slots, dtype=torch.long)
    inter_layers, intra_layers = [], []
    per_span = torch.zeros(len(context))
    per_block = torch.zeros(len(middles))
    lengths = torch.tensor([float(s.end - s.start) for s in context])
    for masses in cached[1]:
        m = masses[rows]  # [S_chunk, U]
        span_mass = m[:, ctx]  # [S_chunk, C]
        if context:
            totals = span_mass.sum(dim=0)
            per_span += totals * per_query
            per_block += span_mass.sum(dim=1)
            inter_layers.append(float((totals * per_query / (size * lengths)).sum()))
        else:
            inter_layers.append(0.0)
        intra_layers.append(float(m[:, own].sum()) * per_query / (size * size))
    a, b = sum(inter_layers) / len(inter_layers), sum(intra_layers) / len(intra_layers)
    cci = 1.0 / (1.0 + math.exp(-a / b)) if b > 0 else 1.0
    total = float(per_span.sum())
    shares = tuple(float(x) / total for x in per_span) if total > 0 else tuple(1.0 / len(context) for _ in context)
    return ChunkStatistics(cci, shares, per_block.to(torch.float16))
