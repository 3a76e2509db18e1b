"""``selection="focus"``: recompute whole the chunks the question reads (Cache-Craft's focused chunks).

When a chunk's KV was computed in another context, its deviation is spread over the whole chunk: a
few blocks recomputed here and there recover little of it (docs/journal/fidelity.md). What the answer
needs is the KV of the chunks the question attends to. Cache-Craft (§3.2.2, Algorithm 1) watches
the question's attention to each chunk, cumulated layer by layer, and finds the *focused* chunks;
it stops recomputing the others. Here the probe's first pass runs the question's rows up to the
probe layer over the cached KV, so the focused chunks are known before anything is recomputed,
and the budget goes to them whole, in order of the question's attention (the one that does not fit
whole gives its first tokens, which depend most on what precedes it); what is left goes to the
most deviated blocks of the other chunks, as ``probe`` does.

With ``recompute_ratio="auto"`` a focused chunk is recomputed whole when its probed deviation
shows it was computed in another context (mean deviation >= the threshold), else only its
deviated blocks; unfocused chunks get their blocks above the threshold; all within the cap.
"""

from __future__ import annotations

import math

import torch

from kvrag.engine.reuse.selection.base import BlendPass, register_selection
from kvrag.engine.reuse.selection.probe import (
    BlockProbe,
    ProbeParams,
    budget_tokens,
    probe_blocks,
    three_passes,
    threshold_of,
)

__all__ = ["focused_chunks", "focus"]


def focused_chunks(cumulative: list[float]) -> list[int]:
    """Cache-Craft's Algorithm 1 on one layer's cumulated attention per chunk: indices of the focused ones.

    Sorted descending, the gaps between neighbours are normalised into a distribution ``p``; its
    cumulative entropy ``h`` grows fastest at the cut; the chunks above the cut are focused.
    """
    k = len(cumulative)
    if k <= 2:
        return list(range(min(k, 1)))
    order = sorted(range(k), key=lambda i: -cumulative[i])
    s = [cumulative[i] for i in order]
    diff = [s[i] - s[i + 1] for i in range(k - 1)]
    total = sum(diff)
    if total <= 0:
        return [order[0]]
    p = [d / total for d in diff]
    h, acc = [], 0.0
    for x in p:
        acc -= x * math.log(x) if x > 0 else 0.0
        h.append(acc)
    cut = max(range(len(h) - 1), key=lambda i: h[i + 1] - h[i]) + 1  # the number of focused chunks
    return order[:cut]


def _chunk_attention(p: BlendPass, meter: BlockProbe) -> tuple[list[float], list[int]]:
    """Per cached chunk: the question's attention cumulated over layers 1..L, and Algorithm 1's focused set."""
    layers = torch.stack(meter.by_layer)  # [L, K] over the cached chunk positions, in position order
    sizes = [b - a for a, b in p.spans]
    per_chunk = torch.stack([part.sum(dim=1) for part in torch.split(layers, sizes, dim=1)], dim=1)  # [L, C]
    cumulative = per_chunk.cumsum(dim=0)
    focused: list[int] = []
    # the focused set once it stays the same for ``w`` layers (Algorithm 1, lines 10-13), else the last
    window = min(3, len(cumulative))
    history = [tuple(sorted(focused_chunks(row.tolist()))) for row in cumulative]
    for layer in range(window - 1, len(history)):
        if len(set(history[layer - window + 1 : layer + 1])) == 1:
            focused = list(history[layer])
            break
    else:
        focused = list(history[-1])
    return cumulative[-1].tolist(), focused


def _mean_deviation(p: BlendPass, meter: BlockProbe) -> list[float]:
    pos = meter.positions
    return [float(meter.deviation[(pos >= a) & (pos < b)].mean()) for a, b in p.spans]


def _by_focus(p: BlendPass, meter: BlockProbe) -> torch.Tensor:
    n, stride, budget = p.plan.num_tokens, p.params.probe_stride, budget_tokens(p)
    threshold = threshold_of(p)
    attention, focused = _chunk_attention(p, meter)
    deviation = _mean_deviation(p, meter)
    chosen = torch.zeros(n, dtype=torch.bool)
    ranked = sorted(range(len(p.spans)), key=lambda i: -attention[i])
    whole = [i for i in ranked if i in focused] if p.budget.auto else ranked
    for i in whole:
        a, b = p.spans[i]
        if p.budget.auto and deviation[i] < threshold:  # computed in a context like this one: blocks will do
            continue
        # a chunk that does not fit gives its first tokens: they depend most on what precedes it
        take = min(b - a, budget)
        chosen[a : a + take] = True
        if take == b - a:
            p.keep_whole(a, b)  # recomputed in this prompt's context: a new variant of the chunk
        budget -= take
        if budget <= 0:
            break
    return probe_blocks(p.spans, n, stride, meter.positions, meter.deviation, budget, threshold, chosen)


def focus(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole focused chunks first, then deviated blocks; the probe's three passes."""
    return three_passes(p, _by_focus, focus=True)


register_selection("focus", focus, params=ProbeParams, auto="threshold")
