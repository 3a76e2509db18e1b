"""``selection="query"``: recompute the blocks the question reads (ProphetKV's query-driven selection).

When a chunk's KV was computed in other company its deviation is spread over the whole chunk, and
blocks ranked by deviation alone spend the budget on tokens that deviate but that the answer never
reads: ProphetKV (arXiv 2602.02579) calls it the crowding-out effect, and ranks the cached tokens by
the attention the user's question pays them instead, fused over layers, recomputing them in a second
stage. Here the probe's first pass already runs the question's rows up to the probe layer over the
cached KV (:mod:`.probe`, ``focus``), so the question's attention to every cached position is known on
layers 1..L before anything is recomputed:

1. each layer's attention over the cached positions is normalised to sum to 1 (every layer weighs the
   same: deep layers' attention is no more trusted than early ones') and the layers are averaged;
2. each ``probe_stride``-token block scores the sum of that fused attention over its tokens, times
   its probed deviation raised to ``query_deviation_weight`` (0: attention alone; 1: the product);
3. blocks are recomputed whole in order of that score until the budget is spent (the probe's second
   and third passes).

Blocks whose deviation is zero (KV cached in this very company) get nothing, as with the probe; with
``recompute_ratio="auto"`` blocks under the calibrated deviation threshold get nothing either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
from kvrag.errors import InvalidRequestError

__all__ = ["QueryParams", "fused_attention", "query_scores", "query"]


@dataclass(frozen=True, slots=True)
class QueryParams(ProbeParams):
    """The probe's parameters and how much the block's deviation weighs beside the question's attention.

    Attributes:
        query_deviation_weight: the exponent of the probed deviation in a block's score (``0``: the
            question's attention alone; ``1``: attention times deviation).
    """

    query_deviation_weight: float = 0.0

    def __post_init__(self) -> None:
        ProbeParams.__post_init__(self)
        w = self.query_deviation_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 4.0:
            raise InvalidRequestError(f"query_deviation_weight must be a number in [0, 4], got {w!r}")

    def resolved(self, n_layers: int) -> QueryParams:
        return dataclasses.replace(self, probe_layer=ProbeParams.resolved(self, n_layers).probe_layer)


def fused_attention(by_layer: list[torch.Tensor]) -> torch.Tensor:
    """[K] the question's attention over the cached positions, each layer's normalised to 1, averaged."""
    layers = torch.stack([x.float() for x in by_layer])  # [L, K]
    layers = layers / layers.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return layers.mean(dim=0)


def query_scores(
    spans: list[tuple[int, int]],
    stride: int,
    keys: torch.Tensor,
    attention: torch.Tensor,
    deviation: torch.Tensor,
    weight: float,
) -> torch.Tensor:
    """[B] each block's score, blocks in the probe's order (spans in order, ``stride`` tokens each).

    ``keys`` [K] are the cached positions ``attention`` [K] is over; ``deviation`` [B] the blocks'
    probed deviation (their middle token's)."""
    at = torch.zeros(int(keys.max()) + 1 if keys.numel() else 0)
    at[keys.cpu()] = attention.cpu()
    ends = [min(a + stride, end) for start, end in spans for a in range(start, end, stride)]
    starts = [a for start, end in spans for a in range(start, end, stride)]
    csum = torch.cat((torch.zeros(1), at.cumsum(0)))
    block = csum[torch.tensor(ends)] - csum[torch.tensor(starts)]  # [B]
    dev = deviation.float().cpu().clamp_min(0.0)
    score = block * dev.pow(weight) if weight > 0 else block.clone()
    score[dev <= 0] = 0.0  # KV cached in this very company: nothing to fix
    return score


def _by_query(p: BlendPass, meter: BlockProbe) -> torch.Tensor:
    n, o = p.plan.num_tokens, p.params
    keys = p.all_pos[p.candidates]
    score = query_scores(
        p.spans, o.probe_stride, keys, fused_attention(meter.by_layer), meter.deviation, o.query_deviation_weight
    )
    p.measured.update(block_attention=score)
    # blocks below the auto threshold (by deviation) are dropped before ranking by score
    threshold = threshold_of(p)
    if threshold > 0:
        score = torch.where(meter.deviation.float().cpu() >= threshold, score, torch.zeros_like(score))
    # the score stands in for the deviation in the probe's block walk
    return probe_blocks(p.spans, n, o.probe_stride, meter.positions, score, budget_tokens(p))


def query(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks in order of the question's fused attention (times deviation^w); the probe's three passes."""
    return three_passes(p, _by_query, focus=True)


register_selection("query", query, params=QueryParams, auto="threshold")
