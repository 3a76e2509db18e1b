"""What the best choice of recomputed tokens could buy: oracle selections for ``benchmarks``.

A research harness, not a kvrag feature. Each oracle sees the full prefill's KV of the very prompt
being blended (it computes it first, so it costs more than a full prefill: its TTFT means nothing)
and recomputes, within the same budget as the other methods (``ceil(ratio × blended tokens)``),
the cached tokens whose KV deviates most from the full prefill's, then runs one pass over them and
the uncached rows. Deviation is the squared K and V difference summed over heads (as the probe's):

- ``otok8``: single tokens, by their deviation on the probe's layer (8 of SmolLM2's 30);
- ``otokall``: single tokens, by the sum over all layers of their deviation (each layer divided by
  its mean over the cached tokens, so every layer weighs the same);
- ``oblkall``: the probe's 16-token blocks, by the mean of that all-layer score over the block.

They register with kvrag's selection registry (with the probe's parameters: its layer and block
size) when this module is imported, and run as ``blend@r+selection=<name>`` beside the shipped
methods, all the bench's arguments passed through; e.g. chunks computed in other company
(docs/benchmarks.md, "The budget alone does not buy it back"):

    python -m benchmarks.research.oracle_selection --dataset ../shared/data/musique_dev.json --n 10 \\
        --top-k 6 --workloads a --warm-company other --config num_threads=1 --methods \\
        full,probe@0.15,blend@0.15+selection=otok8,blend@0.15+selection=otokall,blend@0.15+selection=oblkall
"""

from __future__ import annotations

import sys

import torch

from kvrag.engine.model.runner import KVBuffer, forward
from kvrag.engine.reuse.selection.base import BlendPass, register_selection
from kvrag.engine.reuse.selection.probe import ProbeParams, budget_tokens
from kvrag.kernels import kv_deviation

ORACLES = {"otok8": ("probe", False), "otokall": ("all", False), "oblkall": ("all", True)}


def _full_kv(p: BlendPass) -> KVBuffer:
    """The full prefill's KV of the prompt (every row computed, nothing cached)."""
    n = p.plan.num_tokens
    full = KVBuffer(p.adapter, n)
    with torch.no_grad():
        forward(p.adapter, full, p.ids, p.all_pos, n, last_row_only=True)
    return full


def _scores(p: BlendPass, layers: str) -> torch.Tensor:
    """[N] the cached tokens' deviation from the full prefill's KV (0 elsewhere)."""
    n, full, cached = p.plan.num_tokens, _full_kv(p), KVBuffer(p.adapter, p.plan.num_tokens)
    cand = p.candidates.nonzero().squeeze(1)
    which = [p.params.probe_layer] if layers == "probe" else range(p.adapter.n_layers)
    dev = torch.zeros(cand.numel())
    for layer in which:
        p.source.fill(layer, cached)
        d = kv_deviation(
            full.k[layer][:, cand], cached.k[layer][:, cand], full.v[layer][:, cand], cached.v[layer][:, cand]
        ).cpu()
        dev += d / d.mean().clamp_min(1e-12)
    score = torch.zeros(n)
    score[cand.cpu()] = dev
    return score


def _chosen(p: BlendPass, score: torch.Tensor, blocks: bool) -> torch.Tensor:
    """[N] bool: the budget's worth of cached tokens (or blocks) with the highest score."""
    n, budget = p.plan.num_tokens, budget_tokens(p)
    chosen = torch.zeros(n, dtype=torch.bool)
    if not blocks:
        cand = p.candidates.cpu()
        top = torch.topk(score[cand], min(budget, int(cand.sum()))).indices
        chosen[cand.nonzero().squeeze(1)[top]] = True
        return chosen
    stride = p.params.probe_stride
    found = [(a, min(a + stride, end)) for start, end in p.spans for a in range(start, end, stride)]
    for a, b in sorted(found, key=lambda ab: -float(score[ab[0] : ab[1]].mean())):
        if budget <= 0:
            break
        take = min(b - a, budget)
        chosen[a : a + take] = True
        budget -= take
    return chosen


def oracle(layers: str, blocks: bool):
    def strategy(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = _chosen(p, _scores(p, layers), blocks).to(p.rows.device)
        return p.run(p.all_pos[chosen | p.uncached], last_row_only=True)

    return strategy


for _name, (_layers, _blocks) in ORACLES.items():
    register_selection(_name, oracle(_layers, _blocks), params=ProbeParams)


if __name__ == "__main__":
    from benchmarks.__main__ import main

    sys.exit(main(sys.argv[1:]))
