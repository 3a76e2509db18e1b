"""``selection="craft"``: Cache-Craft's own fix (§3.2.1): a per-chunk budget from the fix overhead, the
tokens its stored attention statistics rank most shaped by their context.

Each blended chunk gets ``CFO * |C|`` of the budget, where the CFO (``CCI * (1 - beta')``, see
:mod:`kvrag.engine.reuse.variants`) says how much the variant's context differs from this prompt's and
how much the chunk depends on its context; inside the chunk, its blocks are recomputed in order of
the inter-attention measured where the variant was computed (``stats["block_inter"]``). Nothing is
probed: one pass. With a fixed ratio the budget is shared in proportion to ``CFO * |C|``; with
``"auto"`` each chunk gets ``ceil(alpha * CFO * |C|)`` within the cap (``alpha`` a parameter, 1 by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvrag.engine.reuse.attention_stats import STATS_STRIDE
from kvrag.engine.reuse.selection.base import BlendPass, SelectionParams, register_selection
from kvrag.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class CraftParams(SelectionParams):
    """Cache-Craft's ``alpha``: the fix overhead's scale, per model (a number > 0)."""

    alpha: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise InvalidRequestError(f"alpha must be a number > 0, got {self.alpha!r}")


__all__ = ["craft_budgets", "craft"]


def craft_budgets(sizes: list[int], fixes: list[float], budget: int) -> list[int]:
    """Tokens per chunk: ``budget`` shared in proportion to ``fix * size``, never more than a chunk has."""
    weights = [f * s for f, s in zip(fixes, sizes)]
    total = sum(weights)
    if total <= 0 or budget <= 0:
        return [0] * len(sizes)
    out = [min(s, math.floor(budget * w / total)) for s, w in zip(sizes, weights)]
    left = budget - sum(out)
    for i in sorted(range(len(sizes)), key=lambda i: -weights[i]):  # the rounding's remainder, biggest first
        if left <= 0:
            break
        extra = min(left, sizes[i] - out[i])
        out[i] += extra
        left -= extra
    return out


def _blocks_by_inter(start: int, end: int, stride: int, block_inter: torch.Tensor | None) -> list[tuple[int, int]]:
    blocks = [(a, min(a + stride, end)) for a in range(start, end, stride)]
    if block_inter is None or block_inter.numel() != len(blocks):
        return blocks  # no statistics: the chunk's first blocks
    order = torch.argsort(block_inter.float(), descending=True, stable=True).tolist()
    return [blocks[i] for i in order]


def craft(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    fix = {u.start: (u.fix if u.fix is not None else 1.0) for u in p.plan.chunks if u.source == "store"}
    records = dict(p.plan.chunk_records)
    sizes = [b - a for a, b in p.spans]
    fixes = [fix.get(a, 1.0) for a, _ in p.spans]
    cap = math.ceil(p.budget.share * sum(sizes))
    if p.budget.auto:
        alpha = p.params.alpha
        budgets = [min(s, math.ceil(alpha * f * s)) for s, f in zip(sizes, fixes)]
        budgets = craft_budgets(sizes, fixes, cap) if sum(budgets) > cap else budgets
    else:
        budgets = craft_budgets(sizes, fixes, cap)
    rows = p.uncached.clone()
    for (a, b), take in zip(p.spans, budgets):
        stats = getattr(records.get(a), "stats", None) or {}
        # the blocks the statistics were measured on (STATS_STRIDE tokens, one sampled query each)
        for x, y in _blocks_by_inter(a, b, STATS_STRIDE, stats.get("block_inter")):
            if take <= 0:
                break
            y = min(y, x + take)
            rows[x:y] = True
            take -= y - x
    return p.run(p.all_pos[rows], last_row_only=True)


register_selection("craft", craft, params=CraftParams, auto="self")
