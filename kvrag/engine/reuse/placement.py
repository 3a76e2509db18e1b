"""Cached KV placed into a request's buffer: each record at its prompt positions, keys rotated there."""

from __future__ import annotations

import torch

from kvrag.engine.model.adapter import ModelAdapter, RopeTable
from kvrag.engine.model.runner import KVBuffer
from kvrag.engine.store.base import KVRecord
from kvrag.kernels import rope_rotate, rope_rotate_into, signed_sin

__all__ = ["SpanSource", "span_mask"]


class SpanSource:
    """Cached KV of a plan (prefix blocks and chunk hits), placed layer by layer at its positions.

    Stored keys carry no RoPE, so one record serves any position; each layer's keys are rotated
    with that layer's own RoPE (Gemma 3's local and global layers differ). Placed one layer at a
    time, just before that layer runs, so a record streaming in from a slower tier is waited for
    layer by layer (:func:`~kvrag.engine.model.runner.forward` calls :meth:`fill`).

    A blend runs some layers in more than one pass (the probe's passes compute sampled rows, then
    the chosen ones, over the same first layers). A layer is placed whole once; a later pass over it
    puts back only the cached positions an earlier pass computed over (:meth:`overwritten`), which
    leaves the buffer as a whole placement would, bit for bit.

    ``within``: the position ranges ``[a, b)`` where cached KV is placed (a deterministic prefill's
    reused slices, :mod:`kvrag.engine.reuse.slices`); None: everywhere the records cover.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        spans: list[tuple[int, KVRecord]],
        rope: RopeTable,
        n: int,
        within: list[tuple[int, int]] | None = None,
    ):
        self.adapter = adapter
        self.spans = spans
        self.rope = rope  # cos/sin [N, D] of every position of the prompt, per layer
        # per span: the [lo, hi) ranges of it placed
        self._parts = [_clip(s, s + r.num_tokens, within) for s, r in spans]
        self._cached = span_mask(n, [p for parts in self._parts for p in parts], adapter.device)  # [N]
        self._placed: set[int] = set()
        self._signed: dict[int, torch.Tensor] = {}  # RoPE kind -> its signed sin [N, D], made once
        self._dirty: dict[int, list[torch.Tensor]] = {}  # layer -> cached positions computed over since

    def fill(self, layer: int, buf: KVBuffer) -> None:
        """Write layer ``layer``'s cached K (rotated to the prompt's positions) and V into ``buf``."""
        if layer in self._placed:
            self._restore(layer, buf)
            return
        dtype = self.adapter.dtype
        cos, sin = self.rope.layer(layer)
        kind = self.rope.kinds[layer]
        if kind not in self._signed:
            self._signed[kind] = signed_sin(sin)
        signed = self._signed[kind]
        for (start, rec), parts in zip(self.spans, self._parts, strict=True):
            if not parts:
                continue
            k, v = rec.layer(layer)  # a record streaming in from disk waits for this layer only
            for lo, hi in parts:
                out = buf.k[layer, :, lo:hi]
                # records from the disk or remote tier (and the 8-bit codec's) rest on the CPU: to the model's device
                kk, vv = k[:, lo - start : hi - start], v[:, lo - start : hi - start]
                rope_rotate_into(out, kk.to(out.device, dtype), cos[lo:hi], sin[lo:hi], signed[lo:hi])
                buf.v[layer, :, lo:hi] = vv.to(out.device, dtype)
        self._placed.add(layer)

    def overwritten(self, layer: int, pos: torch.Tensor) -> None:
        """Rows at ``pos`` [R] were computed on ``layer``: the buffer holds their fresh KV there now."""
        if layer in self._placed:
            hit = pos[self._cached[pos]]
            if hit.numel():
                self._dirty.setdefault(layer, []).append(hit)

    def _restore(self, layer: int, buf: KVBuffer) -> None:
        """Put back the cached KV of the positions computed over on ``layer`` since it was placed."""
        dirty = self._dirty.pop(layer, None)
        if dirty is None:
            return
        pos = torch.cat(dirty).unique()
        dtype = self.adapter.dtype
        cos, sin = self.rope.layer(layer)
        for start, rec in self.spans:
            end = start + rec.num_tokens
            at = pos[(pos >= start) & (pos < end)]
            if at.numel() == 0:
                continue
            k, v = rec.layer(layer)
            idx = (at - start).to(k.device)  # the record may rest on the CPU, the positions on the model's device
            buf.k[layer][:, at] = rope_rotate(k[:, idx].to(buf.k.device, dtype), cos[at], sin[at])
            buf.v[layer][:, at] = v[:, idx].to(buf.v.device, dtype)


def _clip(start: int, end: int, within: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` inside ``within`` (all of it when ``within`` is None)."""
    if within is None:
        return [(start, end)] if end > start else []
    return [(max(start, a), min(end, b)) for a, b in within if max(start, a) < min(end, b)]


def span_mask(n: int, spans: list[tuple[int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[n] bool: True inside any of the [start, end) ``spans`` (a plan's spans as a row mask)."""
    mask = torch.zeros(n, dtype=torch.bool)
    for start, end in spans:
        mask[start:end] = True
    return mask.to(device)
