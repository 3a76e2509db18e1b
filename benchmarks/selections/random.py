"""``selection="random"``: the probe's blocks, picked at random (an ablation, not a method to use).

It runs the probe's three passes (:func:`~kvrag.engine.reuse.selection.probe.three_passes`) and spends
the same budget on the same 16-token blocks, in a random order instead of the probed deviation's,
so against ``probe`` it costs the same and differs only in *which* blocks: what the probe's ranking
buys over chance. The order is seeded by the prompt's tokens, so a prompt always gets the same
blocks. Blocks whose probed deviation is zero (KV computed in this very company) are left alone,
as the probe leaves them.
"""

from __future__ import annotations

import hashlib

import torch

from kvrag.engine.reuse.selection.base import BlendPass, register_selection
from kvrag.engine.reuse.selection.probe import BlockProbe, ProbeParams, budget_tokens, probe_blocks, three_passes

__all__ = ["random_order", "random_blocks"]


def random_order(deviation: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B] random scores in (0, 1], seeded by ``ids``; zero where ``deviation`` is zero."""
    digest = hashlib.sha256(ids.detach().cpu().to(torch.int64).numpy().tobytes()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    scores = 1.0 - torch.rand(deviation.shape, generator=gen)  # (0, 1]
    return torch.where(deviation.detach().cpu() > 0, scores, torch.zeros_like(scores))


def _at_random(p: BlendPass, meter: BlockProbe) -> torch.Tensor:
    n, stride = p.plan.num_tokens, p.params.probe_stride
    scores = random_order(meter.deviation, p.ids)
    return probe_blocks(p.spans, n, stride, meter.positions, scores, budget_tokens(p))


def random_blocks(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
    return three_passes(p, _at_random)


# the probe's parameters: it runs the probe's passes, and compares with the probe at the same setting
register_selection("random", random_blocks, params=ProbeParams)
