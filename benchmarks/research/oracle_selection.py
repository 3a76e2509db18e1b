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

And by what the answer reads (issue 35's answer-impact oracle): the full prefill of the prompt, its
greedy answer (``ANSWER_TOKENS`` tokens) appended, and the attention the question's rows (the
uncached text after the last chunk) and the answer's tokens pay every cached position, on every
layer (softmax over all the keys they see, summed over heads and rows, each layer normalised to 1
and the layers averaged):

- ``oansblk``: the probe's blocks by the question's and the answer's attention;
- ``oanstok``: single tokens by the same;
- ``oqblk``: blocks by the question's attention alone, measured on the full prefill's KV (the best
  a question-driven selection, which cannot see the answer, could know).

They register with kvrag's selection registry (with the probe's parameters: its layer and block
size) when this module is imported, and run as ``blend@r+selection=<name>`` beside the shipped
methods, all the bench's arguments passed through; e.g. chunks computed in other company
(docs/journal/fidelity.md, "The budget alone does not buy it back"):

    python -m benchmarks.research.oracle_selection --dataset ../shared/data/musique_dev.json --n 10 \\
        --top-k 6 --workloads a --warm-company other --config num_threads=1 --methods \\
        full,probe@0.15,blend@0.15+selection=otok8,blend@0.15+selection=otokall,blend@0.15+selection=oblkall
"""

from __future__ import annotations

import sys

import torch

from benchmarks.selections.query import question_blocks
from kvrag.engine.model.runner import KVBuffer, forward
from kvrag.engine.reuse.attention_stats import Tap
from kvrag.engine.reuse.fusion import extend
from kvrag.engine.reuse.selection.base import BlendPass, register_selection
from kvrag.engine.reuse.selection.probe import ProbeParams, block_spans, budget_tokens
from kvrag.kernels import kv_deviation

ORACLES = {"otok8": ("probe", False), "otokall": ("all", False), "oblkall": ("all", True)}
#: name -> (the answer's tokens read too, blocks)
ANSWER_ORACLES = {"oansblk": (True, True), "oanstok": (True, False), "oqblk": (False, True)}
#: Greedy answer tokens whose attention the answer-impact oracles sum (the bench's answers are ~5-30 tokens).
ANSWER_TOKENS = 24


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
    blocks = [(float(score[a:b].mean()), a, b) for a, b in block_spans(p.spans, p.params.probe_stride)]
    return question_blocks(n, blocks, budget)  # by mean score, ties in position order


def _answer_attention(p: BlendPass, with_answer: bool) -> torch.Tensor:
    """[N] the attention the question (and its greedy answer) pays each cached position on the full
    prefill, each layer normalised to 1 over the cached positions, averaged over layers."""
    a, n = p.adapter, p.plan.num_tokens
    last_end = max(b for _, b in p.spans)
    question = p.all_pos[p.uncached & (p.all_pos >= last_end)].tolist()
    ids = p.ids
    with torch.no_grad():
        if with_answer:
            buf = KVBuffer(a, n + ANSWER_TOKENS)
            h, _ = forward(a, buf, p.ids, p.all_pos, n, last_row_only=True)
            answer = [int(torch.argmax(a.logits(h[-1:])[-1]))]
            for t in range(ANSWER_TOKENS - 1):
                logits = extend(a, buf, torch.tensor(answer[-1:]), n + t)
                answer.append(int(torch.argmax(logits[-1])))
            ids = torch.cat((p.ids, torch.tensor(answer, device=p.ids.device)))
        total = int(ids.shape[0])
        rows = question + list(range(n, total))
        tap = Tap(rows, a.n_layers)
        full = KVBuffer(a, total)
        forward(a, full, ids, torch.arange(total, device=ids.device), total, taps=[tap], last_row_only=True)
    qpos = torch.tensor(rows)
    keys = torch.arange(total)
    cand = p.candidates.cpu()
    score = torch.zeros(n)
    for layer, q in enumerate(tap.q):
        k = full.k[layer, :, :total].float()
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        scores = torch.matmul(q.float(), k.transpose(1, 2)) * a.scale  # [H, S, K]
        seen = keys[None, :] <= qpos[:, None]
        w = a.windows[layer] if a.windows else None
        if w is not None:
            seen &= keys[None, :] > qpos[:, None] - w
        mass = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).sum(dim=(0, 1))[:n].cpu()
        mass = mass * cand
        score += mass / mass.sum().clamp_min(1e-12)
    return score / a.n_layers


def answer_oracle(with_answer: bool, blocks: bool):
    def strategy(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = _chosen(p, _answer_attention(p, with_answer), blocks).to(p.rows.device)
        return p.run(p.all_pos[chosen | p.uncached], last_row_only=True)

    return strategy


def oracle(layers: str, blocks: bool):
    def strategy(p: BlendPass) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = _chosen(p, _scores(p, layers), blocks).to(p.rows.device)
        return p.run(p.all_pos[chosen | p.uncached], last_row_only=True)

    return strategy


for _name, (_layers, _blocks) in ORACLES.items():
    register_selection(_name, oracle(_layers, _blocks), params=ProbeParams)
for _name, (_answer, _blocks) in ANSWER_ORACLES.items():
    register_selection(_name, answer_oracle(_answer, _blocks), params=ProbeParams)


if __name__ == "__main__":
    from benchmarks.__main__ import main

    sys.exit(main(sys.argv[1:]))
