"""Batched decoding: one token of many sequences in one pass, its result independent of the batch.

A decode step advances every running sequence by one token. The linear layers (Q/K/V, output,
MLP, LM head) run on all the sequences' rows at once: on a CPU they are bound by reading the
weights, so eight rows cost little more than one. Attention runs per sequence, over that
sequence's own :class:`~kvrag.engine.model.runner.KVBuffer` (ragged lengths, no padding of keys).

A matrix product's rows are not bitwise independent of how many rows it has: here (MKL, AVX2)
``F.linear`` gives one result for 1 row, another for 2-3 rows and a third for 4 or more, on
every shape of the bundled model. A sequence decoded alone would then drift from the same
sequence decoded beside others, and greedy outputs could differ. So rows always go through in
groups of exactly ``group`` rows, padded with dummy rows: every sequence's row sees the same
matrix shape whatever else runs, and its result depends on its own inputs only (rows of one
product do not mix; the tests check it on the tiny model and on the bundled one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.runner import KVBuffer
from kvrag.kernels import attention

__all__ = ["DecodeRow", "decode_step"]


@dataclass(slots=True)
class DecodeRow:
    """One sequence's part of a decode step: put ``token``'s KV at ``pos`` of ``buf``, attend to [0, pos]."""

    buf: KVBuffer
    token: int
    pos: int


@torch.inference_mode()
def decode_step(adapter: ModelAdapter, rows: Sequence[DecodeRow], group: int) -> torch.Tensor:
    """Append one token to each sequence and return the next-token logits [len(rows), V] (float32).

    Rows run in groups of ``group`` (the last one padded), so a row's logits do not depend on the
    other rows of the step. Buffers grow when full.
    """
    out = []
    for first in range(0, len(rows), group):
        out.append(_decode_group(adapter, rows[first : first + group], group))
    return torch.cat(out) if out else torch.empty(0, 0)


def _decode_group(adapter: ModelAdapter, rows: Sequence[DecodeRow], group: int) -> torch.Tensor:
    n, dev = len(rows), adapter.device
    for r in rows:
        if r.pos >= r.buf.capacity:
            r.buf.grow(r.pos + 1)
    pad = group - n  # dummy rows: token 0 at position 0; their outputs are dropped
    ids = torch.tensor([r.token for r in rows] + [0] * pad, device=dev)
    pos = torch.tensor([r.pos for r in rows] + [0] * pad, device=dev)
    h = adapter.embed(ids)  # [G, E]
    rope = adapter.rope(pos)  # cos/sin [G, D] per RoPE of the model
    for layer in range(adapter.n_layers):
        q, k, v = adapter.qkv(layer, h)  # q [H, G, D], k/v [Hkv, G, D]
        cos, sin = rope.layer(layer)
        window = adapter.windows[layer]  # a sliding-window layer's size, or None
        k = adapter.apply_rope(k, cos, sin)
        q = adapter.apply_rope(q, cos, sin)
        att = torch.zeros_like(q)  # padding rows attend to nothing
        for i, r in enumerate(rows):
            bk, bv = r.buf.k[layer], r.buf.v[layer]  # [Hkv, capacity, D]
            bk[:, r.pos] = k[:, i]
            bv[:, r.pos] = v[:, i]
            end = r.pos + 1
            att[:, i : i + 1] = attention(
                q[:, i : i + 1], pos[i : i + 1], bk[:, :end], bv[:, :end], adapter.scale, window=window
            )
        h = adapter.finish_layer(layer, h, att)
    for r in rows:
        r.buf.length = max(r.buf.length, r.pos + 1)
    return adapter.logits(h)[:n]  # the LM head on every row too: its result depends on the row count
