"""Executing a prefill plan: full, exact-prefix, CacheBlend fusion or full reuse."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.engine.model import ModelAdapter
from kvrag.engine.planner import Plan, SpanSource
from kvrag.engine.runner import KVBuffer, KVCapture, Trace, forward
from kvrag.engine.selection import BlockProbe, HKVDSelector, keep_schedule, probe_blocks, probe_sample, recency_window
from kvrag.engine.types import ChunkInfo, GenerationStats

__all__ = ["PrefillResult", "prefill", "extend", "generation_stats"]


@dataclass(slots=True)
class PrefillResult:
    buf: KVBuffer
    last_hidden: torch.Tensor  # [1, E] of the prompt's last token
    trace: Trace
    recomputed_tokens: int  # cached chunk tokens whose KV was recomputed through the last layer
    computed_tokens: int  # prompt tokens computed through the last layer (incl. uncached text)
    capture: KVCapture | None  # exact pre-RoPE KV kept for the prefix cache
    chunk_captures: dict[int, KVCapture]  # segment index -> KV the request computed for that chunk


def prefill(
    adapter: ModelAdapter,
    plan: Plan,
    capacity: int,
    *,
    check_layer: int = 1,
    filter_schedule: tuple[float, ...] = (2.0, 1.5),
    deviation: str = "kv",
    selection: str = "hkvd",
    capture_end: int = 0,
    capture_block: int = 16,
    capture_chunks: tuple[int, ...] = (),
    probe_layer: int = 8,
    probe_stride: int = 16,
) -> PrefillResult:
    """Compute the KV of a plan's prompt into a new buffer of ``capacity`` positions.

    ``capture_end`` > 0 asks to keep the exact pre-RoPE KV of [aligned prefix_len, capture_end)
    for the prefix cache; ``capture_chunks`` (segment indices of chunks computed in full) asks to
    keep those chunks' KV as computed in this prompt. ``probe_layer`` and ``probe_stride`` set the
    probe of ``selection="probe"`` (see :mod:`kvrag.engine.selection`).
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

    chunk_caps = {}
    cached_spans = [(s, s + r.num_tokens) for s, r in plan.chunk_records]
    for i in capture_chunks:  # only chunks computed whole, on every layer
        seg = plan.segments[i]
        if seg.start >= plan.prefix_len and not any(a < seg.end and seg.start < b for a, b in cached_spans):
            chunk_caps[i] = KVCapture(adapter, seg.start, seg.end)
    captures = ([capture] if capture is not None else []) + list(chunk_caps.values())

    full = plan.mode == "full" or (plan.mode == "blend" and plan.ratio >= 1.0)
    if full or (plan.prefix_len == 0 and not plan.chunk_records):
        h, _ = forward(adapter, buf, ids, all_pos, n, capture=captures, trace=trace, last_row_only=True)
        return PrefillResult(buf, h[-1:], trace, 0, n, capture, chunk_caps)

    cos, sin = adapter.rope(all_pos)
    source = SpanSource(adapter, plan.prefix_records + plan.chunk_records, cos, sin)
    candidates = plan.candidates().to(adapter.device)
    rows = all_pos >= plan.prefix_len
    selector = None
    blend = plan.mode == "blend" and plan.ratio > 0 and plan.chunk_records
    if blend and selection == "recency":  # the window is recomputed in full, the other candidates reused
        rows &= ~(candidates & ~recency_window(candidates, plan.ratio, max(b for _, b in cached_spans)))
    elif blend and selection == "probe":
        h, pos = _probe_prefill(
            adapter,
            plan,
            buf,
            ids,
            all_pos,
            rows,
            candidates,
            cached_spans,
            source,
            captures,
            trace,
            deviation,
            probe_layer,
            probe_stride,
        )
        return PrefillResult(buf, h[-1:], trace, int(candidates[pos].sum()), int(pos.numel()), capture, chunk_caps)
    elif blend:
        schedule = keep_schedule(plan.ratio, check_layer, filter_schedule, adapter.n_layers)
        selector = HKVDSelector(candidates, plan.ratio, schedule, deviation)
    else:  # prefix mode has no candidates; reuse never recomputes them
        rows &= ~candidates
    pos = all_pos[rows]
    h, pos = forward(
        adapter,
        buf,
        ids[pos],
        pos,
        n,
        source=source,
        selector=selector,
        capture=captures,
        trace=trace,
        last_row_only=True,
    )
    return PrefillResult(buf, h[-1:], trace, int(candidates[pos].sum()), int(pos.numel()), capture, chunk_caps)


def _probe_prefill(
    adapter,
    plan,
    buf,
    ids,
    all_pos,
    rows,
    candidates,
    cached_spans,
    source,
    captures,
    trace,
    deviation,
    probe_layer,
    probe_stride,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``selection="probe"`` in three passes that compute nothing twice (see :mod:`kvrag.engine.selection`).

    1. The uncached rows before the last cached chunk ("early": what follows them depends on them)
       and the middle token of every ``probe_stride``-token block of the cached chunks, layers
       [0, L); then the sample alone on layer L, where :class:`BlockProbe` compares its fresh KV
       with the cached KV.
    2. The blocks chosen by that deviation (:func:`probe_blocks`) and the uncached rows after the
       last chunk, layers [0, L).
    3. Both row sets, joined in position order, layers [L, end).

    Against one pass over all of them, the early rows' first L layers see the cached (not the
    recomputed) KV of chosen blocks before them.

    Returns:
        (hidden, pos) after the last layer; hidden holds the last row only.
    """
    n, n_layers = plan.num_tokens, adapter.n_layers
    layer = min(probe_layer, n_layers - 1)
    sample = probe_sample(cached_spans, n, probe_stride).to(adapter.device)
    early = rows & ~candidates & (all_pos < max(b for _, b in cached_spans))
    a_pos = all_pos[early | sample]
    h_a, _ = forward(
        adapter, buf, ids[a_pos], a_pos, n, source=source, capture=captures, trace=trace, layers=(0, layer)
    )
    probe = BlockProbe(sample, layer, deviation)
    sampled = sample[a_pos]
    forward(
        adapter,
        buf,
        None,
        a_pos[sampled],
        n,
        hidden=h_a[sampled],
        source=source,
        selector=probe,
        layers=(layer, layer + 1),
    )

    chosen = probe_blocks(cached_spans, n, probe_stride, probe.positions, probe.deviation, plan.ratio)
    b_pos = all_pos[chosen.to(adapter.device) | (rows & ~candidates & ~early)]
    h_b, b_pos = forward(
        adapter, buf, ids[b_pos], b_pos, n, source=source, capture=captures, trace=trace, layers=(0, layer)
    )
    joined = early[a_pos]
    pos, order = torch.sort(torch.cat((a_pos[joined], b_pos)))
    h = torch.cat((h_a[joined], h_b))[order]
    return forward(
        adapter,
        buf,
        None,
        pos,
        n,
        hidden=h,
        source=source,
        capture=captures,
        trace=trace,
        layers=(layer, n_layers),
        last_row_only=True,
    )


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


def generation_stats(plan: Plan, res: PrefillResult, n_layers: int, prefill_s: float) -> GenerationStats:
    """What a prefill did, for :attr:`Generation.stats`."""
    n = plan.num_tokens
    full_work = n * n_layers
    return GenerationStats(
        mode=plan.mode,
        recompute_ratio=plan.ratio,
        prompt_tokens=n,
        cached_tokens=plan.cached_tokens,
        prefix_tokens=plan.prefix_len,
        recomputed_tokens=res.recomputed_tokens,
        computed_tokens=res.computed_tokens,
        compute_fraction=res.trace.token_layers / full_work if full_work else 0.0,
        chunk_hits=sum(c.hit for c in plan.chunks),
        chunk_misses=sum(not c.hit for c in plan.chunks),
        chunks=[ChunkInfo(c.start, c.length, c.hit, c.source, c.tier) for c in plan.chunks],
        prefill_s=prefill_s,
    )
