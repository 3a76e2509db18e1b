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

:class:`Decoder` is the engine's decode step: the plain step (:func:`decode_step`, the adapter's
own layer functions) or, on a CPU, the same arithmetic through weights fused and prepacked once
(:mod:`kvrag.engine.model.packed`) with fewer tensor ops around them; in bfloat16 both give the
same bits (tested on every family and the bundled model), in float32 the packed products are
oneDNN's sums, within 1e-4 of MKL's (and much faster for a step's few rows on an AVX2 CPU).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.packed import DecodeWeights
from kvrag.engine.model.quantized import QUANTIZED_FORMATS, QuantizedWeights
from kvrag.engine.model.runner import KVBuffer
from kvrag.kernels import attention
from kvrag.kernels.row_attention_cpu import row_kernel

__all__ = ["DecodeRow", "Decoder", "decode_step"]


@dataclass(slots=True)
class DecodeRow:
    """One sequence's part of a decode step: put ``token``'s KV at ``pos`` of ``buf``, attend to [0, pos]."""

    buf: KVBuffer
    token: int
    pos: int


class Decoder:
    """Decode steps of up to ``group`` rows per pass (the engine's ``decode_group``).

    Built once per engine: on a CPU it packs the decode weights (:meth:`DecodeWeights.build`, a
    fraction of a second; :attr:`description` says which path and why) and every step uses them;
    elsewhere every step is :func:`decode_step`. ``weights="int8"`` or ``"int4"`` quantizes them
    instead (:mod:`kvrag.engine.model.quantized`, where the kernels are there: else the packed
    path, and the description says why); those products keep rows apart, so a step runs its rows
    only, never padded. ``cache``: a file the quantized weights are read from, or kept in once
    built (:func:`~kvrag.engine.model.quantized.cache_file`).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        group: int,
        weights: str = "plain",
        cache: Path | None = None,
    ) -> None:
        self.adapter = adapter
        self.group = group
        t0 = time.perf_counter()
        self.weights: DecodeWeights | QuantizedWeights | None = None
        refused = ""
        if weights in QUANTIZED_FORMATS:
            self.weights, why = QuantizedWeights.build(adapter, weights, cache)
            refused = "" if self.weights is not None else f"{weights} refused: {why}; "
        if self.weights is None:
            self.weights, why = DecodeWeights.build(adapter, group)
            why = refused + why
        self.build_s = time.perf_counter() - t0
        #: rows never padded: the products keep rows apart (quantized weights)
        self.unpadded = getattr(self.weights, "row_invariant", False)
        #: which decode path runs, and why (``Engine.info().decode``)
        kind = "quantized" if self.unpadded else "packed"
        self.description = (
            f"{kind}: {why} (built in {self.build_s:.2f} s)" if self.weights is not None else f"plain: {why}"
        ) + _row_attention(adapter)

    def step(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Append one token to each sequence and return the next-token logits [len(rows), V] (float32)."""
        if self.weights is None:
            return decode_step(self.adapter, rows, self.group)
        out = []
        for first in range(0, len(rows), self.group):
            part = rows[first : first + self.group]
            out.append(_packed_group(self.adapter, self.weights, part, len(part) if self.unpadded else self.group))
        return torch.cat(out) if out else torch.empty(0, 0)


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


def _inputs(adapter: ModelAdapter, rows: Sequence[DecodeRow], group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions [group] of the rows, padded with dummy rows (token 0 at position 0,
    their outputs dropped); buffers that are full grow first."""
    for r in rows:
        if r.pos >= r.buf.capacity:
            r.buf.grow(r.pos + 1)
    pad = group - len(rows)
    ids = torch.tensor([r.token for r in rows] + [0] * pad, device=adapter.device)
    pos = torch.tensor([r.pos for r in rows] + [0] * pad, device=adapter.device)
    return ids, pos


def _attend(adapter: ModelAdapter, layer: int, rows: Sequence[DecodeRow], pos, q, k, v) -> torch.Tensor:
    """Write each row's k/v [Hkv, G, D] at its position of its buffer; return the rows' attention over
    [0, pos] [H, G, D] (padding rows: zeros).

    Every row's k/v is written first (a row reads only its own prefix, so later rows' writes do not
    reach it). Each row attends straight over its buffer, in the buffer's dtype (:func:`kvrag.kernels.attention`:
    kvrag's row kernel for a bfloat16 row on a CPU, else :func:`~kvrag.kernels.reference.one_row`).
    """
    window = adapter.windows[layer]  # a sliding-window layer's size, or None
    for i, r in enumerate(rows):
        r.buf.k[layer][:, r.pos] = k[:, i]
        r.buf.v[layer][:, r.pos] = v[:, i]
    out = [
        attention(  # the row's position from the host: no wait for the device
            q[:, i : i + 1],
            pos[i : i + 1],
            r.buf.k[layer][:, : r.pos + 1],
            r.buf.v[layer][:, : r.pos + 1],
            adapter.scale,
            window=window,
            span=(r.pos, r.pos),
            decode=True,
        )
        for i, r in enumerate(rows)
    ]
    if len(rows) < q.shape[1]:  # padding rows attend to nothing
        out.append(q.new_zeros(q.shape[0], q.shape[1] - len(rows), q.shape[2]))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def _row_attention(adapter: ModelAdapter) -> str:
    """How a bfloat16 CPU decode row attends (built here, at the engine's start, if it is to be built:
    a few seconds once per machine), as a clause of :attr:`Decoder.description`."""
    if adapter.device.type != "cpu" or adapter.dtype != torch.bfloat16:
        return ""
    kernel, why = row_kernel()
    return "; rows attend through " + ("kvrag's row kernel" if kernel is not None else f"fused SDPA ({why})")


def _finish(rows: Sequence[DecodeRow]) -> None:
    for r in rows:
        r.buf.length = max(r.buf.length, r.pos + 1)


def _decode_group(adapter: ModelAdapter, rows: Sequence[DecodeRow], group: int) -> torch.Tensor:
    ids, pos = _inputs(adapter, rows, group)
    h = adapter.embed(ids)  # [G, E]
    rope = adapter.rope(pos)  # cos/sin [G, D] per RoPE of the model
    for layer in range(adapter.n_layers):
        q, k, v = adapter.qkv(layer, h)  # q [H, G, D], k/v [Hkv, G, D]
        cos, sin = rope.layer(layer)
        k = adapter.apply_rope(k, cos, sin)
        q = adapter.apply_rope(q, cos, sin)
        att = _attend(adapter, layer, rows, pos, q, k, v)  # [H, G, D]
        h = adapter.finish_layer(layer, h, att)
    _finish(rows)
    return adapter.logits(h)[: len(rows)]  # the LM head on every row too: its result depends on the row count


@torch.inference_mode()
def _packed_group(
    adapter: ModelAdapter,
    weights: DecodeWeights | QuantizedWeights,
    rows: Sequence[DecodeRow],
    group: int,
) -> torch.Tensor:
    """:func:`_decode_group` through the packed weights: the same products and elementwise ops in
    the same order (so, in bfloat16, the same bits), with Q/K/V and gate/up as one product each and
    RoPE applied to queries and keys together.

    RoPE: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]`` equals
    ``x * cos + [x2, x1] * [-sin1, sin2]`` bit for bit (a sign moves between two factors), and
    ``[x2, x1]`` is a roll of the last dimension.
    """
    ids, pos = _inputs(adapter, rows, group)
    heads, kv_heads, dim = adapter.n_heads, adapter.n_kv_heads, adapter.head_dim
    half = dim // 2
    h = adapter.embed(ids)  # [G, E]
    rope = adapter.rope(pos)
    # per RoPE of the model: cos and the signed sin [G, 1, D], broadcast over heads
    tables = [(c[:, None], torch.cat((-s[:, :half], s[:, half:]), dim=-1)[:, None]) for c, s in rope.pairs]
    for layer, (w, p) in enumerate(zip(adapter.layers, weights.layers)):
        qkv = p.qkv(adapter.rms_norm(h, w.ln_attn)).view(group, heads + 2 * kv_heads, dim)
        cos, sin = tables[rope.kinds[layer]]
        if w.q_norm is None:
            qk = qkv[:, : heads + kv_heads]
            qk = qk * cos + qk.roll(half, -1) * sin
            q, k = qk[:, :heads], qk[:, heads:]
        else:  # per-head norms before RoPE (Qwen3, Gemma 3)
            q = adapter.rms_norm(qkv[:, :heads], w.q_norm)
            k = adapter.rms_norm(qkv[:, heads : heads + kv_heads], w.k_norm)
            q = q * cos + q.roll(half, -1) * sin
            k = k * cos + k.roll(half, -1) * sin
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), qkv[:, heads + kv_heads :].transpose(0, 1)
        att = _attend(adapter, layer, rows, pos, q, k, v)  # [H, G, D]
        a = p.o(att.transpose(0, 1).reshape(group, heads * dim))
        if w.ln_attn_out is not None:
            a = adapter.rms_norm(a, w.ln_attn_out)
        h = h + a
        gate, up = p.gate_up(adapter.rms_norm(h, w.ln_mlp)).chunk(2, dim=-1)
        m = p.down(adapter.act(gate) * up)
        if w.ln_mlp_out is not None:
            m = adapter.rms_norm(m, w.ln_mlp_out)
        h = h + m
    _finish(rows)
    return weights.lm_head(adapter.rms_norm(h, adapter.norm_weight)).float()[: len(rows)]
