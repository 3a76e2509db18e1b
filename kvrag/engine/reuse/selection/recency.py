"""``selection="recency"``: the cached tokens nearest the question, recomputed in full (no check layer).

The recomputed window is the last ``ceil(ratio * cached)`` cached positions before the end of the
last cached chunk — usually the whole last chunk, whose KV depends most on what now precedes it
and which the question attends to most.
"""

from __future__ import annotations

import math

import torch

from kvrag.engine.reuse.selection.base import BlendPass, register_selection

__all__ = ["recency_window", "recency"]


def recency_window(candidates: torch.Tensor, ratio: float, before: int) -> torch.Tensor:
    """[N] bool: the last ``ceil(ratio * candidates)`` candidate positions before ``before``."""
    cand_pos = candidates[:before].nonzero().squeeze(1)
    k = min(cand_pos.numel(), math.ceil(ratio * int(candidates.sum())))
    window = torch.zeros_like(candidates)
    if k:
        window[cand_pos[cand_pos.numel() - k :]] = True
    return window


def recency(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    window = recency_window(p.candidates, p.budget.share, max(b for _, b in p.spans))
    rows = p.rows & ~(p.candidates & ~window)
    return p.run(p.all_pos[rows], last_row_only=True)


register_selection("recency", recency)
