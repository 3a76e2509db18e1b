"""Executing a prefill plan: full, exact-prefix, CacheBlend fusion or full reuse.

The planner (:mod:`kvrag.engine.reuse.planner`) decides over ids and records; here its plan
becomes tensors: the prompt's ids, the masks of what is reused exactly and what a selection may
recompute, and the placement of cached KV into the request's buffer (:class:`SpanSource`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.runner import KVBuffer, KVCapture, KVSource, QueryTap, Trace, forward
from kvrag.engine.reuse.attention_stats import STATS_STRIDE, Tap, block_middles
from kvrag.engine.reuse.budget import NO_RECOMPUTE, Budget
from kvrag.engine.reuse.placement import SpanSource, span_mask
from kvrag.engine.reuse.planner import Plan
from kvrag.engine.reuse.selection import BlendPass, PrefillOptions, get_selection, selection_params
from kvrag.engine.reuse.slices import canonical_end, plan_slices
from kvrag.engine.types import ChunkInfo, GenerationStats

__all__ = ["PrefillOptions", "PrefillResult", "SpanSource", "span_mask", "prefill", "extend", "generation_stats"]


@dataclass(slots=True)
class PrefillResult:
    buf: KVBuffer
    last_hidden: torch.Tensor  # [1, E] of the prompt's last token
    trace: Trace
    recomputed_tokens: int  # cached chunk tokens whose KV was recomputed through the last layer
    computed_tokens: int  # prompt tokens computed through the last layer (incl. uncached text)
    capture: KVCapture | None  # exact pre-RoPE KV kept for the prefix cache
    chunk_captures: dict[int, KVCapture]  # segment index -> KV the request computed for that chunk
    taps: dict[int, Tap] = field(default_factory=dict)  # segment index -> the tap holding its sampled queries
    measured: dict = field(default_factory=dict)  # what the blend strategy measured (BlendPass.measured)
    tail: KVCapture | None = None  # the prompt's tail computed exactly, kept with ``last_hidden``
    #: segment index -> the capture holding that text between chunks, computed exactly
    #: (:meth:`~kvrag.engine.model.runner.KVCapture.part` of the segment's positions)
    gaps: dict[int, KVCapture] = field(default_factory=dict)
    #: a prefill in fixed slices: the ``[start, end)`` of the slices whose cached KV it used (the
    #: others it computed whole, exact KV there included); None: it used every cached span the plan placed
    reused_slices: list[tuple[int, int]] | None = None


def _held(adapter: ModelAdapter, plan: Plan, capacity: int) -> PrefillResult:
    """A prompt held whole, its tail with its last hidden state: its KV placed, nothing computed."""
    n = plan.num_tokens
    buf = KVBuffer(adapter, capacity)
    source = SpanSource(adapter, plan.cached_spans(), adapter.rope(torch.arange(n, device=adapter.device)), n)
    for layer in range(adapter.n_layers):
        source.fill(layer, buf)
    buf.length = n
    return PrefillResult(buf, _tail_hidden(adapter, plan), Trace(), 0, 0, None, {})


def _tail_hidden(adapter: ModelAdapter, plan: Plan) -> torch.Tensor:
    """The prompt's last hidden state [1, E], kept with its tail."""
    return plan.tail[1].stats["last_hidden"].to(adapter.device, adapter.dtype)


def _captures(
    adapter: ModelAdapter, plan: Plan, options: PrefillOptions, buf: KVBuffer | None = None
) -> tuple[KVCapture | None, dict, KVCapture | None, dict]:
    """The prefix-cache capture (its reused partial block copied in), the missed chunks' captures, the
    tail's (computed exactly: nothing blended before it) and the text between chunks computed exactly
    (segment index -> its capture). ``buf``: the buffer of a pass that computes every row (a full
    prefill); the chunks' values are read from it after the first token instead of copied inside the
    pass.

    One capture per range: merging them into one cost more (measured: a capture past glibc's mmap
    threshold, ~32 MB, is mapped afresh and page-faults on every request; chunk-sized ones reuse
    the heap). The text after a captured chunk, up to the next chunk, rides on that chunk's capture
    (the same copies); only text after KV placed from the cache gets its own."""
    capture = None
    if options.capture_end > plan.prefix_len:
        cap_start = plan.prefix_len - plan.prefix_len % options.capture_block
        capture = KVCapture(adapter, cap_start, options.capture_end)
        if cap_start < plan.prefix_len:  # the reused partial block: copy it from its record
            start, rec = plan.prefix_records[-1]
            a = cap_start - start
            capture.k[:, :, : plan.prefix_len - cap_start] = rec.k[:, :, a:].to(adapter.dtype)
            capture.v[:, :, : plan.prefix_len - cap_start] = rec.v[:, :, a:].to(adapter.dtype)
    cached_spans = [(s, s + r.num_tokens) for s, r in plan.exact_records + plan.chunk_records]

    def computed(seg) -> bool:  # computed whole by this pass
        return seg.start >= plan.prefix_len and not any(a < seg.end and seg.start < b for a, b in cached_spans)

    # text between chunks is kept where the pass is exact (nothing blended) and the tail is kept too
    exact_gaps = options.capture_tail and not plan.chunk_records
    segments = plan.segments

    def gaps_after(i: int) -> list[int]:  # the run of text segments after segment i kept with it
        run = []
        for j in range(i + 1, len(segments)):
            if not (exact_gaps and j in plan.gap_digests and computed(segments[j])):
                break
            run.append(j)
        return run

    chunk_caps, gap_caps = {}, {}
    for i in options.capture_chunks:  # only chunks computed whole, on every layer
        seg = segments[i]
        if computed(seg):
            run = gaps_after(i)
            end = segments[run[-1]].end if run else seg.end
            chunk_caps[i] = KVCapture(adapter, seg.start, seg.end, values_in=buf, extra_end=end)
            gap_caps.update(dict.fromkeys(run, chunk_caps[i]))
    if exact_gaps:  # text after KV placed from the cache (or a chunk not kept): a capture of its own
        for i in plan.gap_digests:
            if i not in gap_caps and computed(segments[i]):
                run = [i, *gaps_after(i)]
                cap = KVCapture(adapter, segments[i].start, segments[run[-1]].end, values_in=buf)
                gap_caps.update(dict.fromkeys(run, cap))
    tail = None
    if options.capture_tail and plan.tail is None and not plan.chunk_records:
        tail = KVCapture(adapter, plan.tail_start(), plan.num_tokens)
    return capture, chunk_caps, tail, gap_caps


def _distinct(*captures: KVCapture | None) -> list[KVCapture]:
    """The captures given, each once (text between chunks shares its chunk's), Nones left out."""
    return list({id(c): c for c in captures if c is not None}.values())


def prefill(
    adapter: ModelAdapter,
    plan: Plan,
    capacity: int,
    *,
    budget: Budget = NO_RECOMPUTE,
    options: PrefillOptions,
    pause: Callable[[], None] | None = None,
) -> PrefillResult:
    """Compute the KV of a plan's prompt into a new buffer of ``capacity`` positions.

    By the plan's path: ``full`` computes every row; ``prefix`` and ``reuse`` compute the rows
    without cached KV; ``blend`` hands the prefill to the selection strategy of ``budget.selection``
    (:mod:`kvrag.engine.reuse.selection`), which recomputes within ``budget``. ``pause`` reaches
    every layer pass (:func:`~kvrag.engine.model.runner.forward`).
    """
    n = plan.num_tokens
    if options.slice_tokens and not plan.chunk_records:  # exact: in fixed slices (nothing blended)
        return _sliced(adapter, plan, capacity, options, pause)
    if plan.tail is not None and plan.exact_tokens == n:
        return _held(adapter, plan, capacity)
    buf = KVBuffer(adapter, capacity)
    trace = Trace()
    all_pos = torch.arange(n, device=adapter.device)
    ids = torch.tensor(plan.ids, dtype=torch.long, device=adapter.device)  # [N]
    whole = plan.is_full or not plan.cached_spans()  # one pass computes every row
    capture, chunk_caps, tail, gaps = _captures(adapter, plan, options, buf if whole else None)
    captures = _distinct(capture, *chunk_caps.values(), *gaps.values(), tail)
    middles = [m for c in chunk_caps.values() for m in block_middles(c.start, c.end, STATS_STRIDE)]
    tap = Tap(sorted(middles), adapter.n_layers) if middles else None
    taps = [tap] if tap is not None else []

    if whole:
        h, _ = forward(
            adapter, buf, ids, all_pos, n, capture=captures, taps=taps, trace=trace, last_row_only=True, pause=pause
        )
        taps_of = dict.fromkeys(chunk_caps, tap)
        return PrefillResult(buf, h[-1:], trace, 0, n, capture, chunk_caps, taps_of, tail=tail, gaps=gaps)

    source = SpanSource(adapter, plan.cached_spans(), adapter.rope(all_pos), n)
    candidates = span_mask(n, plan.blended_spans(), adapter.device)  # [N] blended chunk KV: may be recomputed
    rows = ~span_mask(n, plan.exact_spans(), adapter.device)  # [N] not reused exactly
    measured: dict = {}
    kept_taps = dict.fromkeys(chunk_caps, tap)
    if plan.path == "blend" and budget.share > 0 and plan.chunk_records:
        params = options.params if options.params is not None else selection_params(budget.selection)
        options = dataclasses.replace(options, params=params.resolved(adapter.n_layers))
        blend = BlendPass(
            adapter=adapter, plan=plan, budget=budget, buf=buf, ids=ids, all_pos=all_pos, rows=rows,
            candidates=candidates, spans=plan.blended_spans(), source=source, captures=captures,
            taps=taps, trace=trace, options=options, pause=pause,
        )  # fmt: skip
        h, pos = get_selection(budget.selection)(blend)
        measured = blend.measured
        index = {u.start: u.index for u in plan.chunks}
        for start, (cap, whole_tap) in blend.kept.items():  # cached chunks recomputed whole: new variants
            chunk_caps[index[start]] = cap
            kept_taps[index[start]] = whole_tap
    else:  # prefix mode has no candidates; reuse never recomputes them
        pos = all_pos[rows & ~candidates]
        h, pos = forward(
            adapter,
            buf,
            ids[pos],
            pos,
            n,
            source=source,
            capture=captures,
            taps=taps,
            trace=trace,
            last_row_only=True,
            pause=pause,
        )
    computed = int(pos.numel())
    recomputed = int(candidates[pos].sum())
    last = h[-1:] if plan.tail is None else _tail_hidden(adapter, plan)  # the tail's rows were not computed
    return PrefillResult(buf, last, trace, recomputed, computed, capture, chunk_caps, kept_taps, measured, tail, gaps)


def _sliced(
    adapter: ModelAdapter, plan: Plan, capacity: int, options: PrefillOptions, pause: Callable[[], None] | None
) -> PrefillResult:
    """An exact plan's prefill in fixed slices (:mod:`kvrag.engine.reuse.slices`): a slice is reused
    when cached KV computed so covers it, else computed whole: the full prefill's bits."""
    n, size = plan.num_tokens, options.slice_tokens
    spans = plan.prefix_records + plan.exact_records  # no blended records on this path
    slices = plan_slices(n, size, [(s, canonical_end(r, s, size, n)) for s, r in spans])
    reused = [(a, b) for a, b, r in slices if r]
    if len(reused) == len(slices):  # the prompt held whole (its tail kept with its hidden state)
        return dataclasses.replace(_held(adapter, plan, capacity), reused_slices=reused)
    buf = KVBuffer(adapter, capacity)
    trace = Trace()
    ids = torch.tensor(plan.ids, dtype=torch.long, device=adapter.device)  # [N]
    capture, chunk_caps, tail, gaps = _captures(adapter, plan, options)
    canonical = n - n % size  # the end of the prompt's last full slice: past it, what a prompt this long computes
    captures = _distinct(capture, *chunk_caps.values(), *gaps.values(), tail)
    for cap in captures:
        cap.slices = (size, canonical, n)
    middles = [m for c in chunk_caps.values() for m in block_middles(c.start, c.end, STATS_STRIDE)]
    tap = Tap(sorted(middles), adapter.n_layers) if middles else None
    source = None
    if reused:
        source = SpanSource(adapter, spans, adapter.rope(torch.arange(n, device=adapter.device)), n, within=reused)
    h, computed = _run_slices(
        adapter, buf, ids, slices, source=source, capture=captures, taps=[tap] if tap is not None else [],
        trace=trace, pause=pause,
    )  # fmt: skip
    last = h if h is not None else _tail_hidden(adapter, plan)
    kept_taps = dict.fromkeys(chunk_caps, tap)
    return PrefillResult(
        buf, last, trace, 0, computed, capture, chunk_caps, kept_taps, tail=tail, gaps=gaps, reused_slices=reused
    )


def _run_slices(
    adapter: ModelAdapter,
    buf: KVBuffer,
    ids: torch.Tensor,
    slices: list[tuple[int, int, bool]],
    *,
    source: KVSource | None = None,
    capture: list[KVCapture] | tuple = (),
    taps: list[QueryTap] | tuple = (),
    trace: Trace | None = None,
    pause: Callable[[], None] | None = None,
) -> tuple[torch.Tensor | None, int]:
    """Compute the slices not reused, in order, each over the keys up to its end (``ids`` [N]: the
    prompt's). Returns the last slice's last hidden state [1, E] (None if that slice was reused) and
    the rows computed."""
    h, computed = None, 0
    for a, b, reused in slices:
        if reused:
            continue
        pos = torch.arange(a, b, device=ids.device)
        # only the prompt's last row needs the last layer's output; each slice still writes all its KV
        h, _ = forward(
            adapter, buf, ids[a:b], pos, b, source=source, capture=capture, taps=taps, trace=trace,
            last_row_only=True, pause=pause, split_tail=True,
        )  # fmt: skip
        computed += b - a
    if slices and slices[-1][2]:
        h = None
    buf.length = max(buf.length, slices[-1][1] if slices else 0)
    return (None if h is None else h[-1:]), computed


def extend(
    adapter: ModelAdapter, buf: KVBuffer, ids: torch.Tensor, start: int, *, pause: Callable[[], None] | None = None
) -> torch.Tensor:
    """Append tokens at positions [start, start + T) and return their logits [T, V].

    Grows the buffer if needed. Used for scoring continuations (decoding runs batched:
    :mod:`kvrag.engine.model.batch`).
    """
    t = int(ids.shape[0])
    if start + t > buf.capacity:
        buf.grow(start + t)
    pos = torch.arange(start, start + t, device=adapter.device)
    h, _ = forward(adapter, buf, ids.to(adapter.device), pos, start + t, pause=pause)
    return adapter.logits(h)


def generation_stats(
    plan: Plan, budget: Budget, res: PrefillResult, n_layers: int, prefill_s: float
) -> GenerationStats:
    """What a prefill of ``plan`` with ``budget`` did, for :attr:`Generation.stats`."""
    n = plan.num_tokens
    full_work = n * n_layers
    blended = sum(r.num_tokens for _, r in plan.chunk_records)
    exact, prefix = plan.exact_tokens, plan.prefix_len
    if res.reused_slices is not None:  # what ran: the cached KV of the slices reused, not all the plan found
        exact = sum(b - a for a, b in res.reused_slices)
        prefix = sum(max(0, min(b, prefix) - a) for a, b in res.reused_slices)
    return GenerationStats(
        mode=plan.mode,
        path=plan.path,
        path_reason=plan.reason,
        recompute_ratio=(res.recomputed_tokens / blended if blended else 0.0) if budget.auto else budget.share,
        auto=budget.auto,
        selection=budget.selection if plan.path == "blend" else "",
        prompt_tokens=n,
        cached_tokens=exact + blended,
        prefix_tokens=prefix,
        exact_tokens=exact,
        recomputed_tokens=res.recomputed_tokens,
        computed_tokens=res.computed_tokens,
        compute_fraction=res.trace.token_layers / full_work if full_work else 0.0,
        chunk_hits=sum(c.hit for c in plan.chunks),
        chunk_misses=sum(not c.hit for c in plan.chunks),
        chunks_found=sum(c.found for c in plan.chunks),
        chunks=[ChunkInfo(c.start, c.length, c.hit, c.source, c.tier, c.fix, c.overlap) for c in plan.chunks],
        prefill_s=prefill_s,
    )
