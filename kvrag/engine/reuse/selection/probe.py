"""``selection="probe"``: recompute the 16-token blocks a deep-layer probe finds most changed.

Each cached chunk is cut into blocks of ``probe_stride`` tokens; a probe computes the middle token
of every block up to ``probe_layer`` (:class:`ProbeParams`) and compares its fresh KV with the
cached KV there; blocks are recomputed whole in order of that deviation until the budget is spent.
On SmolLM2 the deviation that changes the answer can stay hidden at layer 1 and grow from layer ~8
on, where CacheBlend's layer-1 ranking does not see it (docs/journal/selection.md, *Why the probe*).

The probe also measures how much the question attends to each cached chunk on the probe layer
(its rows run with the probe, on the cached KV), for a strategy that spends the budget on the
chunks the question reads (the benchmarks' ``focus``). Both run the prefill in three passes that
compute nothing twice but the question's first layers:

1. The uncached rows before the last cached chunk ("early": what follows them depends on them),
   the uncached rows after it (the question, "late") and the sample (every block's middle token),
   layers [0, L); then the sample and the question alone on layer L, where :class:`BlockProbe`
   compares the sample's fresh KV with the cached KV and the question's attention over the chunks.
2. The blocks chosen (:func:`probe_blocks` or another strategy's ``choose``) and the late rows, layers [0, L).
3. Both row sets, joined in position order, layers [L, end).

Against one pass over all of them, the early rows' first L layers see the cached (not the
recomputed) KV of chosen blocks before them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrag.checks import integer
from kvrag.engine.model.runner import KVBuffer
from kvrag.engine.reuse.selection.base import BlendPass, SelectionParams, check_deviation, register_selection
from kvrag.kernels import kv_deviation

__all__ = ["ProbeParams", "BlockProbe", "block_spans", "probe_sample", "probe_blocks", "probe", "three_passes"]


@dataclass(frozen=True, slots=True)
class ProbeParams(SelectionParams):
    """The probe's parameters (``probe``, and the benchmarks' ``focus`` and ``random``).

    The names are those of ``EngineConfig.selection_params`` and of the benchmarks' method specs
    (``probe@0.15+probe_layer=12``); the calibrated ``auto`` threshold belongs to one setting of them
    (:func:`kvrag.engine.reuse.calibration.probe_key`).

    Attributes:
        probe_layer: the layer the probe compares; ``None``: a quarter of the depth plus one (layer 8
            of SmolLM2's 30). Never below 1 (layer 0's KV does not depend on context), and at most
            the last layer but one.
        probe_stride: the block size: one token is probed per block, blocks are recomputed whole.
        deviation: what the KV deviation compares: ``k``, ``v`` or ``kv`` (the sum of both).
    """

    probe_layer: int | None = None
    probe_stride: int = 16
    deviation: str = "kv"

    def __post_init__(self) -> None:
        integer(1, also=(None,), note="layer 0's KV does not depend on context")("probe_layer", self.probe_layer)
        integer(1)("probe_stride", self.probe_stride)
        check_deviation(self.deviation)

    def resolved(self, n_layers: int) -> ProbeParams:
        """``probe_layer`` settled for a model of ``n_layers`` layers (see :attr:`probe_layer`)."""
        layer = self.probe_layer if self.probe_layer is not None else n_layers // 4 + 1
        return dataclasses.replace(self, probe_layer=max(1, min(layer, n_layers - 1)))


class BlockProbe:
    """Measures, on one layer, the sample's KV deviation and the question's attention; ends the pass.

    Run as the selector of a pass over the sample and the question rows: on ``layer`` it compares
    the sampled rows' fresh KV with the cached KV in the buffer (:attr:`positions`,
    :attr:`deviation`), and when ``question`` rows are given, the attention mass their queries
    put on every cached chunk position (:attr:`attention`, summed over heads and rows, softmax
    over the cached chunk keys only: the other keys of that layer are not all in the buffer yet),
    also on every layer before (:attr:`by_layer`). It keeps no rows.
    """

    def __init__(
        self,
        sample: torch.Tensor,
        layer: int,
        deviation: str = "kv",
        *,
        question: torch.Tensor | None = None,
        keys: torch.Tensor | None = None,
        scale: float = 1.0,
        windows: list[int | None] | None = None,
    ) -> None:
        self.sample, self.layer, self.what = sample, layer, deviation
        self.question, self.keys, self.scale, self.windows = question, keys, scale, windows
        self.positions: torch.Tensor | None = None  # [S] sampled positions
        self.deviation: torch.Tensor | None = None  # [S] their deviation on ``layer``
        self.attention: torch.Tensor | None = None  # [K] the question's attention mass on each key of ``keys``
        self.by_layer: list[torch.Tensor] = []  # the same on layers 1..layer, in order

    def wants(self, layer: int) -> bool:
        return layer == self.layer or (self.question is not None and 1 <= layer < self.layer)

    def select(self, layer: int, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buf: KVBuffer):
        if self.question is not None and self.keys is not None:
            self._attend(layer, pos, q, buf)
        if layer != self.layer:  # an earlier layer of the pass: only the question's attention
            return None
        rows = self.sample[pos].nonzero().squeeze(1)
        self.positions = pos[rows]
        self.deviation = kv_deviation(
            k[:, rows], buf.k[layer][:, self.positions], v[:, rows], buf.v[layer][:, self.positions], self.what
        )
        return pos.new_empty(0)

    def _attend(self, layer: int, pos: torch.Tensor, q: torch.Tensor, buf: KVBuffer) -> None:
        asking = self.question[pos].nonzero().squeeze(1)
        hkv, (h, rq, d) = buf.k.shape[1], (q.shape[0], int(asking.numel()), q.shape[2])
        keys = buf.k[layer][:, self.keys]  # [Hkv, K, D]: cached KV at every chunk position on this layer
        # the query heads sharing a KV head side by side ([Hkv, G * Rq, D]): no copy of the keys per head
        grouped = q[:, asking].reshape(hkv, (h // hkv) * rq, d)
        scores = torch.matmul(grouped, keys.transpose(1, 2)).float() * self.scale  # [Hkv, G * Rq, K]
        window = self.windows[layer] if self.windows else None
        if window is not None:  # a sliding-window layer: each question row sees the last ``window`` keys
            far = self.keys[None, :] <= pos[asking][:, None] - window  # [Rq, K]
            scores = scores.view(hkv, h // hkv, rq, -1).masked_fill(far, float("-inf")).view(hkv, h // hkv * rq, -1)
        mass = torch.softmax(scores, dim=-1).nan_to_num(0.0).sum(dim=(0, 1))  # [K]
        self.attention = mass  # on the probe layer
        self.by_layer.append(mass)


def block_spans(spans: list[tuple[int, int]], stride: int):
    """(start, end) of every ``stride``-token block of each span, in order (the last one of a span shorter)."""
    for start, end in spans:
        for a in range(start, end, stride):
            yield a, min(a + stride, end)


def probe_sample(spans: list[tuple[int, int]], n: int, stride: int) -> torch.Tensor:
    """[N] bool: the middle token of every block of ``stride`` tokens of each span."""
    sample = torch.zeros(n, dtype=torch.bool)
    for a, b in block_spans(spans, stride):
        sample[a + (b - a) // 2] = True
    return sample


def probe_blocks(
    spans: list[tuple[int, int]],
    n: int,
    stride: int,
    positions: torch.Tensor,
    deviation: torch.Tensor,
    budget: int,
    threshold: float = 0.0,
    chosen: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N] bool: blocks recomputed whole, in order of their middle token's deviation, within ``budget`` tokens.

    The last block reached gives its first tokens only, so the budget is never exceeded. Blocks
    whose deviation is zero (KV cached in this very context) or below ``threshold``
    (``recompute_ratio="auto"``) get nothing, and so do positions already in ``chosen`` (which the
    result extends).
    """
    block_of = {a + (b - a) // 2: (a, b) for a, b in block_spans(spans, stride)}
    chosen = torch.zeros(n, dtype=torch.bool) if chosen is None else chosen.clone()
    order = torch.argsort(deviation, descending=True, stable=True).tolist()
    dev, pos = deviation.tolist(), positions.tolist()
    for i in order:
        if budget <= 0 or dev[i] <= 0 or dev[i] < threshold:
            break
        a, b = block_of[pos[i]]
        free = (~chosen[a:b]).nonzero().squeeze(1)
        take = free[:budget] + a
        chosen[take] = True
        budget -= take.numel()
    return chosen


def budget_tokens(p: BlendPass) -> int:
    """The recompute budget of a blend pass, in tokens: ``ceil(share * blended tokens)``."""
    return math.ceil(p.budget.share * sum(b - a for a, b in p.spans))


def threshold_of(p: BlendPass) -> float:
    """The deviation below which a block is not recomputed (``auto`` only)."""
    b = p.budget
    return b.threshold if b.auto and b.threshold is not None else 0.0


Choose = Callable[[BlendPass, BlockProbe], torch.Tensor]


def three_passes(p: BlendPass, choose: Choose, *, focus: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's three passes (module docstring) with ``choose(p, probe) -> [N] bool`` picking what
    is recomputed; ``focus`` also measures the question's attention over the cached chunks."""
    o, n, n_layers = p.params, p.plan.num_tokens, p.adapter.n_layers
    layer = min(o.probe_layer, n_layers - 1)
    sample = probe_sample(p.spans, n, o.probe_stride).to(p.adapter.device)
    last_end = max(b for _, b in p.spans)
    early = p.uncached & (p.all_pos < last_end)
    late = p.uncached & ~early if focus else torch.zeros_like(early)
    a_pos = p.all_pos[early | sample | late]
    keys = p.all_pos[p.candidates] if focus else None
    meter = BlockProbe(
        sample,
        layer,
        o.deviation,
        question=late if focus else None,
        keys=keys,
        scale=p.adapter.scale,
        windows=p.adapter.windows,
    )
    h_a, _ = p.run(a_pos, layers=(0, layer), selector=meter if focus else None)
    measured = (sample | late)[a_pos]
    p.run(a_pos[measured], hidden=h_a[measured], selector=meter, layers=(layer, layer + 1), record=False)

    ends = torch.tensor([b for _, b in block_spans(p.spans, o.probe_stride)])
    starts = torch.tensor([a for a, _ in block_spans(p.spans, o.probe_stride)])
    p.measured.update(block_sizes=ends - starts, block_deviation=meter.deviation.detach().cpu())
    chosen = choose(p, meter).to(p.adapter.device)
    b_pos = p.all_pos[chosen | (p.uncached & ~early)]
    h_b, b_pos = p.run(b_pos, layers=(0, layer))
    joined = early[a_pos]
    pos, order = torch.sort(torch.cat((a_pos[joined], b_pos)))
    h = torch.cat((h_a[joined], h_b))[order]
    return p.run(pos, hidden=h, layers=(layer, n_layers), last_row_only=True)


def _by_deviation(p: BlendPass, meter: BlockProbe) -> torch.Tensor:
    n, stride = p.plan.num_tokens, p.params.probe_stride
    return probe_blocks(p.spans, n, stride, meter.positions, meter.deviation, budget_tokens(p), threshold_of(p))


def probe(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks in order of their probed deviation; returns the last row's hidden state and the rows computed."""
    return three_passes(p, _by_deviation)


register_selection("probe", probe, params=ProbeParams, auto="threshold")
