"""``selection="epic"``: the first tokens of every cached chunk, recomputed in full (EPIC's LegoLink).

EPIC (Hu et al., arXiv 2410.15332) finds that a chunk whose KV was computed on its own starts with
an attention sink of its own: its first tokens draw attention that, inside a longer prompt, belongs
to the prompt's real beginning. LegoLink recomputes the first ``k`` tokens of every chunk (and
the question) through all layers, with no check layer and no ranking: O(k x chunks) extra work.
With kvrag's default neighbour context the same tokens are those with the least of their own
chunk to attend to, so their KV leans most on whatever the chunk was computed behind.

Here the budget is the engine's: ``ceil(ratio * cached tokens)``, split evenly over the cached
chunks, each spending its share on its own first tokens (:func:`epic_tokens`). One pass over
those rows and the uncached ones, as :mod:`kvrag.engine.reuse.selection.recency` does.
"""

from __future__ import annotations

import math

import torch

from kvrag.engine.reuse.selection.base import BlendPass, register_selection

__all__ = ["epic_shares", "epic_tokens", "epic"]


def epic_shares(lengths: list[int], budget: int) -> list[int]:
    """Tokens each chunk recomputes: ``budget`` split as evenly as the chunks' lengths allow.

    A chunk shorter than its share gives all its tokens and leaves the rest to the longer ones;
    where the budget does not divide evenly, the shorter chunks get the one extra token. The
    shares add up to ``min(budget, sum(lengths))``.
    """
    shares = [0] * len(lengths)
    left = min(budget, sum(lengths))
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # shortest first
    for done, i in enumerate(order):
        share = -(-left // (len(order) - done))  # ceil: what is left, over the chunks left
        shares[i] = min(lengths[i], share)
        left -= shares[i]
    return shares


def epic_tokens(spans: list[tuple[int, int]], n: int, ratio: float) -> torch.Tensor:
    """[N] bool: the first tokens of each span, ``ceil(ratio * cached tokens)`` in all."""
    lengths = [b - a for a, b in spans]
    chosen = torch.zeros(n, dtype=torch.bool)
    for (a, _), share in zip(spans, epic_shares(lengths, math.ceil(ratio * sum(lengths)))):
        chosen[a : a + share] = True
    return chosen


def epic(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = epic_tokens(p.spans, p.plan.num_tokens, p.budget.share).to(p.adapter.device)
    rows = p.rows & ~(p.candidates & ~chosen)
    return p.run(p.all_pos[rows], last_row_only=True)


register_selection("epic", epic)
