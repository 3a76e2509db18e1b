"""Which cached tokens get their KV recomputed: CacheBlend's HKVD selection by gradual filtering.

On the check layer every token's KV is recomputed and compared with its cached KV; the tokens of
highest KV deviation (HKVD) are kept, a share ``s_0 = m_0 * r`` of the cached tokens. On each next
layer of the schedule only the kept tokens are recomputed and compared again, keeping
``s_i = m_i * r`` (non-increasing), until the share reaches the target ratio ``r`` (CacheBlend
§4.3, Fig. 9). Tokens without cached KV (uncached text, the question) are always computed.

All cached tokens of the request are ranked together, as CacheBlend does. ``selection="probe"``
ranks blocks instead, at a deeper layer: each cached chunk is cut into blocks of ``probe_stride``
tokens; a probe computes the middle token of every block up to ``probe_layer`` and compares its
fresh KV with the cached KV there; blocks are recomputed whole in order of that deviation until the
budget is spent. On SmolLM2 the deviation that changes the answer can stay hidden at layer 1 and
grow from layer ~8 on (the README's *Why the probe*).
"""

from __future__ import annotations

import math

import torch

from kvrag.config import SELECTIONS
from kvrag.engine.runner import KVBuffer
from kvrag.kernels import kv_deviation, topk

__all__ = [
    "HKVDSelector",
    "BlockProbe",
    "probe_sample",
    "probe_blocks",
    "keep_schedule",
    "recency_window",
    "SELECTIONS",
]


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
    """

    def __init__(
        self,
        candidates: torch.Tensor,
        ratio: float,
        schedule: dict[int, float],
        deviation: str = "kv",
    ) -> None:
        self.candidates = candidates
        self.n_candidates = int(candidates.sum())
        self.ratio = ratio
        self.schedule = schedule
        self.deviation = deviation
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
        chosen = cand_rows[topk(dev, math.ceil(share * self.n_candidates))]
        keep = torch.ones_like(cand)
        keep[cand_rows] = False
        keep[chosen] = True
        rows = keep.nonzero().squeeze(1)
        self.selected = pos[chosen]
        return rows


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
