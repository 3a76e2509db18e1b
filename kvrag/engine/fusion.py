"""Executing a prefill plan: full, exact-prefix, CacheBlend fusion or full reuse."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.engine.model import ModelAdapter
from kvrag.engine.planner import Plan, SpanSource
from kvrag.engine.runner import KVBuffer, KVCapture, Trace, forward
from kvrag.engine.selection import HKVDSelector, keep_schedule

__all__ = ["PrefillResult", "prefill", "extend"]


@dataclass(slots=True)
class PrefillResult:
    buf: KVBuffer
    last_hidden: torch.Tensor  # [1, E] of the prompt's last token
    trace: Trace
    recomputed_tokens: int  # cached chunk tokens whose KV was recomputed through the last layer
    computed_tokens: int  # prompt tokens computed through the last layer (incl. uncached text)
    capture: KVCapture | None  # exact pre-RoPE KV kept for the prefix cache


def prefill(
    adapter: ModelAdapter,
    plan: Plan,
    capacity: int,
    *,
    check_layer: int = 1,
    filter_schedule: tuple[float, ...] = (2.0, 1.5),
    deviation: str = "kv",
    selection_score: str = "deviation",
    capture_end: int = 0,
    capture_block: int = 16,
) -> PrefillResult:
    """Compute the KV of a plan's prompt into a new buffer of ``capacity`` positions.

    ``capture_end`` > 0 asks to keep the exact pre-RoPE KV of [aligned prefix_len, capture_end)
    for the prefix cache.
    """
    n = plan.num_tokens
    buf = KVBuffer(adapter, capacity)
    trace = Trace()
    all_pos = torch.arange(n, device=adapter.device)
    ids = plan.ids.to(adapter.device)
    capture = None
    if capture_end > plan.prefix_len:
        cap_start = plan.prefix_len - plan.prefix_len % capture_block
        capture = KVCapture(adapter, cap_start, capture_end)
        if cap_start < plan.prefix_len:  # the reused partial block: copy it from its record
            start, rec = plan.prefix_records[-1]
            a = cap_start - start
            capture.k[:, :, : plan.prefix_len - cap_start] = rec.k[:, :, a:].to(adapter.dtype)
            capture.v[:, :, : plan.prefix_len - cap_start] = rec.v[:, :, a:].to(adapter.dtype)

    full = plan.mode == "full" or (plan.mode == "blend" and plan.ratio >= 1.0)
    if full or (plan.prefix_len == 0 and not plan.chunk_records):
        h, _ = forward(adapter, buf, ids, all_pos, n, capture=capture, trace=trace)
        return PrefillResult(buf, h[-1:], trace, 0, n, capture)

    cos, sin = adapter.rope(all_pos)
    source = SpanSource(adapter, plan.prefix_records + plan.chunk_records, cos, sin)
    candidates = plan.candidates().to(adapter.device)
    rows = all_pos >= plan.prefix_len
    selector = None
    if plan.mode == "blend" and plan.ratio > 0 and plan.chunk_records:
        schedule = keep_schedule(plan.ratio, check_layer, filter_schedule, adapter.n_layers)
        last = plan.segments[-1]
        query_pos = torch.arange(last.start, last.end) if last.kind == "text" else all_pos[-1:]
        selector = HKVDSelector(
            candidates, plan.ratio, schedule, deviation, score=selection_score, query_pos=query_pos, scale=adapter.scale
        )
    else:  # prefix mode has no candidates; reuse never recomputes them
        rows &= ~candidates
    pos = all_pos[rows]
    h, pos = forward(adapter, buf, ids[pos], pos, n, source=source, selector=selector, capture=capture, trace=trace)
    recomputed = int(candidates[pos].sum())
    return PrefillResult(buf, h[-1:], trace, recomputed, int(pos.numel()), capture)


def extend(adapter: ModelAdapter, buf: KVBuffer, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Append tokens at positions [start, start + T) and return their logits [T, V].

    Grows the buffer if needed. Used for decoding (T = 1) and for scoring continuations.
    """
    t = int(ids.shape[0])
    if start + t > buf.capacity:
        buf.grow(start + t)
    pos = torch.arange(start, start + t, device=adapter.device)
    h, _ = forward(adapter, buf, ids.to(adapter.device), pos, start + t)
    return adapter.logits(h)
