"""Which cached tokens get their KV recomputed: CacheBlend's HKVD selection by gradual filtering.

On the check layer every token's KV is recomputed and compared with its cached KV; the tokens of
highest KV deviation (HKVD) are kept, a share ``s_0 = m_0 * r`` of the cached tokens. On each next
layer of the schedule only the kept tokens are recomputed and compared again, keeping
``s_i = m_i * r`` (non-increasing), until the share reaches the target ratio ``r`` (CacheBlend
§4.3, Fig. 9). Tokens without cached KV (uncached text, the question) are always computed.

By default all cached tokens of the request are ranked together, as CacheBlend does. With
per-chunk quotas (``selection="probe"``) the budget is first given to chunks: a probe computes a
sample of each chunk's tokens up to a deeper layer, where the deviation that changes the answer
shows (on SmolLM2 the layer-1 ranking missed a chunk whose deviation only grows from layer ~8 on),
and whole chunks are recomputed in order of their sampled deviation until the budget is spent;
HKVD ranks tokens only inside the chunk that gets part of the budget.
"""

from __future__ import annotations

import math

import torch

from kvrag.config import SELECTIONS
from kvrag.engine.runner import KVBuffer
from kvrag.kernels import kv_deviation, topk

__all__ = [
    "HKVDSelector", "ChunkProbe", "chunk_quotas", "probe_sample", "keep_schedule", "recency_window", "SELECTIONS"
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
        span_ids: optional [N] int64 chunk index of each position (-1 elsewhere), with ``quotas``.
        quotas: chunk index -> tokens it keeps at the target ratio (a step keeping ``s`` keeps
            ``quota * s / ratio``); chunks not listed keep none. Without it the request's cached
            tokens are ranked together.
    """

    def __init__(
        self,
        candidates: torch.Tensor,
        ratio: float,
        schedule: dict[int, float],
        deviation: str = "kv",
        span_ids: torch.Tensor | None = None,
        quotas: dict[int, int] | None = None,
    ) -> None:
        if (span_ids is None) != (quotas is None):
            raise ValueError("span_ids and quotas go together")
        self.candidates = candidates
        self.n_candidates = int(candidates.sum())
        self.ratio = ratio
        self.schedule = schedule
        self.deviation = deviation
        self.span_ids = span_ids
        self.quotas = quotas
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
        if self.quotas is None:
            chosen = cand_rows[topk(dev, math.ceil(share * self.n_candidates))]
        else:
            spans = self.span_ids[cpos]
            parts = [cand_rows.new_empty(0)]
            for sid, quota in self.quotas.items():
                members = (spans == sid).nonzero().squeeze(1)
                keep_n = min(members.numel(), math.ceil(quota * share / self.ratio))
                if keep_n:
                    parts.append(members[topk(dev[members], keep_n)])
            chosen = cand_rows[torch.sort(torch.cat(parts)).values]
        keep = torch.ones_like(cand)
        keep[cand_rows] = False
        keep[chosen] = True
        rows = keep.nonzero().squeeze(1)
        self.selected = pos[chosen]
        return rows


class ChunkProbe:
    """Measures each cached chunk's KV deviation on a sample of its tokens at one layer, then stops.

    Run as the selector of a forward pass over the uncached rows and the sample: on ``layer`` it
    compares the sample's fresh KV with the cached KV, records each chunk's mean deviation in
    :attr:`deviation` and keeps no rows (the pass ends there).

    Args:
        span_ids: [N] chunk index of each position (-1 elsewhere).
        sample: [N] bool, the sampled cached positions.
        layer: the layer compared.
        deviation: ``k``, ``v`` or ``kv``.
    """

    def __init__(self, span_ids: torch.Tensor, sample: torch.Tensor, layer: int, deviation: str = "kv") -> None:
        self.span_ids, self.sample, self.layer, self.what = span_ids, sample, layer, deviation
        self.deviation: dict[int, float] = {}

    def wants(self, layer: int) -> bool:
        return layer == self.layer

    def select(self, layer: int, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buf: KVBuffer):
        rows = self.sample[pos].nonzero().squeeze(1)
        spos = pos[rows]
        dev = kv_deviation(k[:, rows], buf.k[layer][:, spos], v[:, rows], buf.v[layer][:, spos], self.what)
        spans = self.span_ids[spos]
        for sid in torch.unique(spans).tolist():
            self.deviation[sid] = float(dev[spans == sid].mean())
        return pos.new_empty(0)


def probe_sample(spans: list[tuple[int, int]], n: int, stride: int) -> torch.Tensor:
    """[N] bool: every ``stride``-th token of each span from offset ``stride // 2`` (one at least)."""
    sample = torch.zeros(n, dtype=torch.bool)
    for start, end in spans:
        sample[start + min(stride // 2, end - start - 1) : end : stride] = True
    return sample


def chunk_quotas(sizes: list[int], deviation: dict[int, float], ratio: float) -> dict[int, int]:
    """Recompute budget per chunk: whole chunks in order of deviation until ``ratio`` of all is spent.

    The last chunk reached gets what is left; chunks of zero deviation get nothing.
    """
    budget = math.ceil(ratio * sum(sizes))
    quotas: dict[int, int] = {}
    for sid in sorted(deviation, key=lambda i: (-deviation[i], i)):
        if budget <= 0 or deviation[sid] <= 0:
            break
        quotas[sid] = min(sizes[sid], budget)
        budget -= quotas[sid]
    return quotas
