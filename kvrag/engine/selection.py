"""Which cached tokens get their KV recomputed: CacheBlend's HKVD selection by gradual filtering.

On the check layer every token's KV is recomputed and compared with its cached KV; the tokens of
highest KV deviation (HKVD) are kept, a share ``s_0 = m_0 * r`` of the cached tokens. On each next
layer of the schedule only the kept tokens are recomputed and compared again, keeping
``s_i = m_i * r`` (non-increasing), until the share reaches the target ratio ``r`` (CacheBlend
§4.3, Fig. 9). Tokens without cached KV (uncached text, the question) are always computed.

The budget can be split per chunk (``per_span=True``) so each chunk keeps its own share; the
default ranks all cached tokens of the request together, as CacheBlend does.
"""

from __future__ import annotations

import math

import torch

from kvrag.config import SELECTIONS
from kvrag.engine.runner import KVBuffer
from kvrag.kernels import kv_deviation, topk

__all__ = ["HKVDSelector", "keep_schedule", "recency_window", "SELECTIONS"]



def recency_window(candidates: torch.Tensor, ratio: float, before: int) -> torch.Tensor:
    """[N] bool: the last ``ceil(ratio * candidates)`` candidate positions before ``before``."""
    cand_pos = candidates[:before].nonzero().squeeze(1)
    k = min(cand_pos.numel(), math.ceil(ratio * int(candidates.sum())))
    window = torch.zeros_like(candidates)
    if k:
        window[cand_pos[cand_pos.numel() - k :]] = True
    return window


def keep_schedule(ratio: float, check_layer: int, multipliers: tuple[float, ...], n_layers: int) -> dict[int, float]:
    """Layer -> share of cached tokens kept after that layer's comparison."""
    shares = [min(1.0, m * ratio) for m in multipliers] + [ratio]
    out: dict[int, float] = {}
    for i, share in enumerate(shares):
        layer = check_layer + i
        if layer >= n_layers:
            break
        out[layer] = share
    return out


class HKVDSelector:
    """Gradual-filtering HKVD selection over the cached tokens of one request.

    Args:
        candidates: [N] bool, True where a position holds cached chunk KV (may be recomputed).
        ratio: target share of candidates recomputed on the later layers.
        schedule: layer -> share kept after that layer (see :func:`keep_schedule`).
        deviation: ``k``, ``v`` or ``kv``.
        span_ids: optional [N] int64 chunk index of each position (-1 elsewhere); with it, each
            chunk keeps its own share of its tokens.
    """

    def __init__(
        self,
        candidates: torch.Tensor,
        ratio: float,
        schedule: dict[int, float],
        deviation: str = "kv",
        span_ids: torch.Tensor | None = None,
    ) -> None:
        self.candidates = candidates
        self.n_candidates = int(candidates.sum())
        self.ratio = ratio
        self.schedule = schedule
        self.deviation = deviation
        self.span_ids = span_ids
        self.selected: torch.Tensor | None = None  # positions kept after the last step

    def wants(self, layer: int) -> bool:
        return layer in self.schedule

    def select(self, layer: int, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buf: KVBuffer):
        share = self.schedule.get(layer)
        if share is None:
            return None
        cand = self.candidates[pos]  # [R]
        cand_rows = cand.nonzero().squeeze(1)
        if cand_rows.numel() == 0:
            return None
        cpos = pos[cand_rows]
        dev = kv_deviation(
            k[:, cand_rows], buf.k[layer][:, cpos], v[:, cand_rows], buf.v[layer][:, cpos], self.deviation
        )
        if self.span_ids is None:
            chosen = cand_rows[topk(dev, math.ceil(share * self.n_candidates))]
        else:
            spans = self.span_ids[cpos]
            parts = []
            for sid in torch.unique(spans).tolist():
                members = (spans == sid).nonzero().squeeze(1)
                total = int((self.span_ids == sid).sum())
                parts.append(members[topk(dev[members], math.ceil(share * total))])
            chosen = cand_rows[torch.sort(torch.cat(parts)).values]
        keep = torch.ones_like(cand)
        keep[cand_rows] = False
        keep[chosen] = True
        rows = keep.nonzero().squeeze(1)
        self.selected = pos[chosen]
        return rows
