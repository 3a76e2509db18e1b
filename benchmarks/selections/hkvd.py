"""``selection="hkvd"``: CacheBlend's high-KV-deviation tokens, by gradual filtering (§4.3).

On the check layer every cached token's KV is recomputed and compared with its cached KV; the
tokens of highest KV deviation (HKVD) are kept, a share ``s_0 = m_0 * r`` of the cached tokens. On
each next layer of the schedule only the kept tokens are recomputed and compared again, keeping
``s_i = m_i * r`` (non-increasing), until the share reaches the target ratio ``r`` (Fig. 9). All
cached tokens of the request are ranked together, as CacheBlend does. Tokens without cached KV
(uncached text, the question) are always computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvrag.engine.model.runner import KVBuffer
from kvrag.engine.reuse.selection.base import BlendPass, SelectionParams, check_deviation, register_selection
from kvrag.errors import InvalidRequestError
from kvrag.kernels import kv_deviation, topk

__all__ = ["HKVDParams", "HKVDSelector", "keep_schedule", "hkvd"]


@dataclass(frozen=True, slots=True)
class HKVDParams(SelectionParams):
    """HKVD's parameters (``EngineConfig.selection_params`` with ``selection="hkvd"``).

    Attributes:
        check_layer: the layer on which selection starts: every cached token's KV is recomputed
            there and compared with the cached KV. Layer 0's KV does not depend on context, so 1.
        filter_schedule: gradual filtering (CacheBlend §4.3). Entry ``i`` is the share of cached
            tokens kept after layer ``check_layer + i``, as a multiple of the recompute ratio; the
            schedule ends at the ratio itself. ``(2.0, 1.5)`` keeps 2r after the check layer, 1.5r
            after the next one and r from then on. Non-increasing, each >= 1.0.
        deviation: what the KV deviation compares: ``k``, ``v`` or ``kv`` (the sum of both).
    """

    check_layer: int = 1
    filter_schedule: tuple[float, ...] = (2.0, 1.5)
    deviation: str = "kv"

    def __post_init__(self) -> None:
        layer = self.check_layer
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
            raise InvalidRequestError(
                f"check_layer must be an integer >= 1 (layer 0's KV does not depend on context), got {layer!r}"
            )
        schedule = self.filter_schedule
        numbers = isinstance(schedule, (list, tuple)) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in schedule
        )
        if not numbers or any(not x >= 1.0 for x in schedule) or list(schedule) != sorted(schedule, reverse=True):
            raise InvalidRequestError(
                f"filter_schedule must be non-increasing multiples >= 1.0 (e.g. (2.0, 1.5)), got {schedule!r}"
            )
        object.__setattr__(self, "filter_schedule", tuple(float(x) for x in schedule))
        check_deviation(self.deviation)


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

    def __init__(self, candidates: torch.Tensor, ratio: float, schedule: dict[int, float], deviation: str = "kv"):
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


def hkvd(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row after the exact prefix enters; the selector prunes cached ones from the check layer on."""
    o = p.params
    schedule = keep_schedule(p.budget.share, o.check_layer, o.filter_schedule, p.adapter.n_layers)
    selector = HKVDSelector(p.candidates, p.budget.share, schedule, o.deviation)
    return p.run(p.all_pos[p.rows], selector=selector, last_row_only=True)


register_selection("hkvd", hkvd, params=HKVDParams)
