"""``selection="query"``: recompute the blocks the question reads (ProphetKV's query-driven selection).

When a chunk's KV was computed in another context its deviation is spread over the whole chunk, and
blocks ranked by deviation spend the budget on tokens that deviate but that the answer never reads:
ProphetKV (arXiv 2602.02579) calls it the crowding-out effect, and ranks the cached tokens by the
attention the user's question pays them, fused over layers, in two stages:

1. **The question over the cached KV.** The uncached rows (the text before the chunks, the question)
   run through the layers up to ``query_layers`` (three quarters of the depth) with the cached chunk
   KV in place and nothing recomputed; on each of those layers from 1 on, the attention the
   question's rows pay every cached position is measured (softmax over the cached chunk keys, summed
   over heads and rows: :class:`~kvrag.engine.reuse.selection.probe.BlockProbe`'s). Each layer's is
   normalised to 1 and the layers are averaged, so deep layers, where the answer is read, weigh as
   much as early ones. That pass computes a few percent of a full prefill's rows; it costs ~0.24 s
   of CPU here (~60 ms of it placing cached KV that the recompute needs anyway) against the probe's
   ~0.15 s sample pass.
2. **The recompute.** Each ``probe_stride``-token block of the cached chunks scores the fused
   attention on its tokens; blocks are recomputed whole in that order until the budget is spent, in
   one pass with the uncached rows (which the first stage computed over the stale KV: they are
   computed again here, over the recomputed blocks). This pass is most of the cost: the question
   reads the last chunks, whose rows attend over ~2.5x the keys of the probe's, so it costs ~1.26x
   the probe's whole prefill on its own and ``selection="query"`` ~1.4-1.5x the probe's TTFT
   (docs/journal/issue-35-query-driven.md, "Where the time goes").

Measured on the dev set (docs/journal/issue-35-query-driven.md, "Query-driven recompute"), chunks computed in other
company, 15% recomputed: an oracle ranking blocks by the question's attention on the *full* prefill's
KV over all layers cuts the probe's drift by 15%, this selection by 15-17% (every layer, or up to
layer 22 of SmolLM2's 30), at ~1.35x the probe's TTFT; the question's attention on layers 1..8
only (the probe's depth) by 3%.

With ``recompute_ratio="auto"`` it takes the fixed share ``config.auto_ratio`` (it measures no
deviation to hold against the probe's calibrated threshold).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvrag.engine.model.runner import KVBuffer
from kvrag.engine.reuse.selection.base import BlendPass, register_selection
from kvrag.engine.reuse.selection.probe import ProbeParams, block_spans, budget_tokens
from kvrag.errors import InvalidRequestError

__all__ = ["QueryParams", "QuestionMeter", "fused_attention", "block_scores", "question_blocks", "query"]


@dataclass(frozen=True, slots=True)
class QueryParams(ProbeParams):
    """The probe's block size (``probe_stride``) and how deep the question runs over the cached KV.

    Attributes:
        query_layers: the last layer whose attention is measured: the first stage stops there
            (``None``, the default: three quarters of the depth, layer 22 of SmolLM2's 30, which
            measured as well as every layer on the dev set at less cost; fewer cost less still but
            measured worse: see the module docstring).
    """

    query_layers: int | None = None

    def __post_init__(self) -> None:
        ProbeParams.__post_init__(self)
        n = self.query_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise InvalidRequestError(
                f"query_layers must be an integer >= 1 or None (three quarters of the depth), got {n!r}"
            )

    def resolved(self, n_layers: int) -> QueryParams:
        last = (3 * n_layers) // 4 if self.query_layers is None else self.query_layers
        last = max(1, min(last, n_layers - 1))
        return dataclasses.replace(ProbeParams.resolved(self, n_layers), query_layers=last)


class QuestionMeter:
    """The first stage's selector: on layers 1..``last`` the attention the ``question`` rows pay the
    cached ``keys`` [K] (:attr:`by_layer`); it ends the pass on ``last``, before that layer's attention.

    :class:`~kvrag.engine.reuse.selection.probe.BlockProbe`'s measure (softmax of the scaled scores over
    the cached keys only, summed over heads and rows), bit for bit, with what it spent for nothing
    left out: the cached keys are read in place when they are one run of positions (the chunks side
    by side, the usual prompt) instead of being gathered into a copy on every layer; the question's
    rows are not gathered when they are all the pass's rows; the upcast scores are scaled in place;
    ``nan_to_num`` runs only on a sliding-window layer, the one where a row can see none of the keys.
    """

    def __init__(
        self, question: torch.Tensor, keys: torch.Tensor, last: int, scale: float, windows: list[int | None]
    ) -> None:
        self.question, self.keys, self.last, self.scale, self.windows = question, keys, last, scale, windows
        k0 = int(keys[0]) if keys.numel() else 0
        one_run = keys.numel() > 0 and int(keys[-1]) - k0 + 1 == keys.numel()
        self._run = (k0, k0 + keys.numel()) if one_run else None  # the keys as one slice of positions
        self._rows: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (pos, question rows or None: all)
        self.by_layer: list[torch.Tensor] = []  # [K] on layers 1..last, in order

    def wants(self, layer: int) -> bool:
        return 1 <= layer <= self.last

    def select(self, layer: int, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buf: KVBuffer):
        self.by_layer.append(self._attend(layer, pos, q, buf))
        return pos.new_empty(0) if layer == self.last else None

    def _asking(self, pos: torch.Tensor) -> torch.Tensor | None:
        """The question's rows among ``pos`` (None: all of them), found once per pass (no row is dropped)."""
        if self._rows is None or self._rows[0] is not pos:
            asking = self.question[pos].nonzero().squeeze(1)
            self._rows = (pos, None if asking.numel() == pos.numel() else asking)
        return self._rows[1]

    def _attend(self, layer: int, pos: torch.Tensor, q: torch.Tensor, buf: KVBuffer) -> torch.Tensor:
        asking = self._asking(pos)
        qa = q if asking is None else q[:, asking]
        hkv, (h, rq, d) = buf.k.shape[1], qa.shape
        if self._run is not None:
            keys = buf.k[layer, :, self._run[0] : self._run[1]]  # [Hkv, K, D], a view
        else:
            keys = buf.k[layer][:, self.keys]
        grouped = qa.reshape(hkv, (h // hkv) * rq, d)  # the query heads sharing a KV head side by side
        scores = torch.matmul(grouped, keys.transpose(1, 2)).float().mul_(self.scale)  # [Hkv, G * Rq, K]
        window = self.windows[layer] if self.windows else None
        if window is None:
            return torch.softmax(scores, dim=-1).sum(dim=(0, 1))
        rows = pos if asking is None else pos[asking]
        far = self.keys[None, :] <= rows[:, None] - window  # [Rq, K]
        scores = scores.view(hkv, h // hkv, rq, -1).masked_fill(far, float("-inf")).view(hkv, h // hkv * rq, -1)
        return torch.softmax(scores, dim=-1).nan_to_num(0.0).sum(dim=(0, 1))


def fused_attention(by_layer: list[torch.Tensor]) -> torch.Tensor:
    """[K] attention over the cached positions, each layer's normalised to sum to 1, averaged over layers."""
    layers = torch.stack([x.float() for x in by_layer])  # [L, K]
    layers = layers / layers.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return layers.mean(dim=0)


def block_scores(
    spans: list[tuple[int, int]], stride: int, keys: torch.Tensor, attention: torch.Tensor
) -> list[tuple[float, int, int]]:
    """(score, start, end) of every ``stride``-token block of ``spans``: the ``attention`` [K] on its
    positions (``keys`` [K], increasing)."""
    at = torch.zeros(int(keys.max()) + 1 if keys.numel() else 0)
    at[keys.cpu()] = attention.float().cpu()
    csum = torch.cat((torch.zeros(1), at.cumsum(0))).tolist()
    return [(csum[b] - csum[a], a, b) for a, b in block_spans(spans, stride)]


def question_blocks(n: int, blocks: list[tuple[float, int, int]], budget: int) -> torch.Tensor:
    """[N] bool: blocks whole in order of their score (ties: the earlier first) within ``budget``
    tokens; the last block reached gives its first tokens, which depend most on what precedes it."""
    chosen = torch.zeros(n, dtype=torch.bool)
    for _, a, b in sorted(blocks, key=lambda x: (-x[0], x[1])):
        if budget <= 0:
            break
        take = min(b - a, budget)
        chosen[a : a + take] = True
        budget -= take
    return chosen


def query(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    """The question over the cached KV, then the blocks it reads most recomputed (module docstring)."""
    n, last = p.plan.num_tokens, p.params.query_layers
    last_end = max(b for _, b in p.spans)
    question = p.uncached & (p.all_pos >= last_end)
    keys = p.all_pos[p.candidates]
    meter = QuestionMeter(question, keys, last, p.adapter.scale, p.adapter.windows)
    rows = p.all_pos[p.uncached]
    p.run(rows, selector=meter, layers=(0, last + 1), record=False)
    attention = fused_attention(meter.by_layer)
    blocks = block_scores(p.spans, p.params.probe_stride, keys, attention)
    p.measured.update(block_attention=torch.tensor([s for s, _, _ in blocks]))
    chosen = question_blocks(n, blocks, budget_tokens(p)).to(p.rows.device)
    return p.run(p.all_pos[chosen | p.uncached], last_row_only=True)


register_selection("query", query, params=QueryParams)
