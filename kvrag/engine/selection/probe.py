"""``selection="probe"`` (the default): recompute the 16-token blocks a deep-layer probe finds most changed.

Each cached chunk is cut into blocks of ``probe_stride`` tokens; a probe computes the middle token
of every block up to ``probe_layer`` and compares its fresh KV with the cached KV there; blocks are
recomputed whole in order of that deviation until the budget is spent. On SmolLM2 the deviation
that changes the answer can stay hidden at layer 1 and grow from layer ~8 on, where CacheBlend's
layer-1 ranking does not see it (docs/benchmarks.md, *Why the probe*).

The prefill runs in three passes that compute nothing twice:

1. The uncached rows before the last cached chunk ("early": what follows them depends on them)
   and the sample (every block's middle token), layers [0, L); then the sample alone on layer L,
   where :class:`BlockProbe` compares its fresh KV with the cached KV.
2. The blocks chosen by that deviation (:func:`probe_blocks`) and the uncached rows after the
   last chunk, layers [0, L).
3. Both row sets, joined in position order, layers [L, end).

Against one pass over all of them, the early rows' first L layers see the cached (not the
recomputed) KV of chosen blocks before them.
"""

from __future__ import annotations

import math

import torch

from kvrag.engine.runner import KVBuffer
from kvrag.engine.selection.base import BlendPass, register_selection
from kvrag.kernels import kv_deviation

__all__ = ["BlockProbe", "probe_sample", "probe_blocks", "probe"]


class BlockProbe:
    """Measures the KV deviation of sampled cached tokens on one layer, then ends the pass.

    Run as the selector of a pass over the sample (and whatever it attends to): on ``layer`` it
    compares the sampled rows' fresh KV with the cached KV in the buffer, keeps the result in
    :attr:`positions` / :attr:`deviation` and keeps no rows.
    """

    def __init__(self, sample: torch.Tensor, layer: int, deviation: str = "kv") -> None:
        self.sample, self.layer, self.what = sample, layer, deviation
        self.positions: torch.Tensor | None = None  # [S] sampled positions
        self.deviation: torch.Tensor | None = None  # [S] their deviation on ``layer``

    def wants(self, layer: int) -> bool:
        return layer == self.layer

    def select(self, layer: int, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buf: KVBuffer):
        rows = self.sample[pos].nonzero().squeeze(1)
        self.positions = pos[rows]
        self.deviation = kv_deviation(
            k[:, rows], buf.k[layer][:, self.positions], v[:, rows], buf.v[layer][:, self.positions], self.what
        )
        return pos.new_empty(0)


def _blocks(spans: list[tuple[int, int]], stride: int):
    for start, end in spans:
        for a in range(start, end, stride):
            yield a, min(a + stride, end)


def probe_sample(spans: list[tuple[int, int]], n: int, stride: int) -> torch.Tensor:
    """[N] bool: the middle token of every block of ``stride`` tokens of each span."""
    sample = torch.zeros(n, dtype=torch.bool)
    for a, b in _blocks(spans, stride):
        sample[a + (b - a) // 2] = True
    return sample


def probe_blocks(
    spans: list[tuple[int, int]], n: int, stride: int, positions: torch.Tensor, deviation: torch.Tensor, ratio: float
) -> torch.Tensor:
    """[N] bool: the blocks to recompute, whole, in order of their middle token's deviation.

    The budget is ``ceil(ratio * cached tokens)``; the last block reached gives its first tokens
    only, so the budget is never exceeded. Blocks of zero deviation (KV cached in this very
    context) get nothing.
    """
    block_of = {a + (b - a) // 2: (a, b) for a, b in _blocks(spans, stride)}
    budget = math.ceil(ratio * sum(b - a for a, b in spans))
    chosen = torch.zeros(n, dtype=torch.bool)
    order = torch.argsort(deviation, descending=True, stable=True).tolist()
    dev, pos = deviation.tolist(), positions.tolist()
    for i in order:
        if budget <= 0 or dev[i] <= 0:
            break
        a, b = block_of[pos[i]]
        b = min(b, a + budget)
        chosen[a:b] = True
        budget -= b - a
    return chosen


def probe(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    """The three passes (module docstring); returns the last row's hidden state and the rows computed."""
    o, n, n_layers = p.options, p.plan.num_tokens, p.adapter.n_layers
    layer = min(o.probe_layer, n_layers - 1)
    sample = probe_sample(p.spans, n, o.probe_stride).to(p.adapter.device)
    early = p.uncached & (p.all_pos < max(b for _, b in p.spans))
    a_pos = p.all_pos[early | sample]
    h_a, _ = p.run(a_pos, layers=(0, layer))
    meter = BlockProbe(sample, layer, o.deviation)
    sampled = sample[a_pos]
    p.run(a_pos[sampled], hidden=h_a[sampled], selector=meter, layers=(layer, layer + 1), record=False)

    chosen = probe_blocks(p.spans, n, o.probe_stride, meter.positions, meter.deviation, p.plan.ratio)
    b_pos = p.all_pos[chosen.to(p.adapter.device) | (p.uncached & ~early)]
    h_b, b_pos = p.run(b_pos, layers=(0, layer))
    joined = early[a_pos]
    pos, order = torch.sort(torch.cat((a_pos[joined], b_pos)))
    h = torch.cat((h_a[joined], h_b))[order]
    return p.run(pos, hidden=h, layers=(layer, n_layers), last_row_only=True)


register_selection("probe", probe)
