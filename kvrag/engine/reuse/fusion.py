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

from kvrag.engine.model.adapter import ModelAdapter, RopeTable
from kvrag.engine.model.runner import KVBuffer, KVCapture, Trace, forward
from kvrag.engine.reuse.attention_stats import STATS_STRIDE, Tap, block_middles
from kvrag.engine.reuse.planner import Plan
from kvrag.engine.reuse.selection import BlendPass, SelectionParams, configured_params, get_selection, selection_params
from kvrag.engine.store.base import KVRecord
from kvrag.engine.types import ChunkInfo, GenerationStats
from kvrag.kernels import rope_rotate, rope_rotate_into, signed_sin

__all__ = ["PrefillOptions", "PrefillResult", "SpanSource", "span_mask", "prefill", "extend", "generation_stats"]


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
    """

    def __init__(self, adapter: ModelAdapter, spans: list[tuple[int, KVRecord]], rope: RopeTable, n: int):
        self.adapter = adapter
        self.spans = spans
        self.rope = rope  # cos/sin [N, D] of every position of the prompt, per layer
        self._cached = span_mask(n, [(s, s + r.num_tokens) for s, r in spans], adapter.device)  # [N]
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
        for start, rec in self.spans:
            end = start + rec.num_tokens
            k, v = rec.layer(layer)  # a record streaming in from disk waits for this layer only
            out = buf.k[layer, :, start:end]
            # records from the disk or remote tier (and the 8-bit codec's) rest on the CPU: moved to the model's device
            rope_rotate_into(out, k.to(out.device, dtype), cos[start:end], sin[start:end], signed[start:end])
            buf.v[layer, :, start:end] = v.to(out.device, dtype)
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


def span_mask(n: int, spans: list[tuple[int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[n] bool: True inside any of the [start, end) ``spans`` (a plan's spans as a row mask)."""
    mask = torch.zeros(n, dtype=torch.bool)
    for start, end in spans:
        mask[start:end] = True
    return mask.to(device)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillOptions:
    """How one prefill runs, besides its plan: the selection strategy, its parameters, what to capture.

    Attributes:
        selection: the ``blend`` strategy's name (see :mod:`kvrag.engine.reuse.selection`).
        params: the strategy's parameters (its registered :class:`SelectionParams` subclass);
            ``None``: its defaults. :func:`prefill` resolves them for the model before the strategy
            sees them (``BlendPass.params``).
        capture_end: > 0 keeps the exact pre-RoPE KV of [aligned prefix_len, capture_end) for the
            prefix cache.
        capture_block: the prefix cache's block size (the capture starts on a block boundary).
        capture_chunks: segment indices of missed chunks whose KV, computed whole in this prompt,
            is kept (write-back of their real context).
        auto_threshold: with ``plan.auto``, the deviation from which a measuring strategy recomputes.
        auto_alpha: with ``plan.auto``, Cache-Craft's alpha (``selection="craft"``).
        keep_recomputed: keep cached chunks a strategy recomputes whole as new variants.
    """

    selection: str = "probe"
    params: SelectionParams | None = None
    capture_end: int = 0
    capture_block: int = 16
    capture_chunks: tuple[int, ...] = ()
    auto_threshold: float | None = None
    auto_alpha: float = 1.0
    keep_recomputed: bool = False

    @classmethod
    def from_config(cls, config, n_layers: int, **fields) -> PrefillOptions:
        """Options from an :class:`~kvrag.EngineConfig` for a model of ``n_layers`` layers; ``fields``
        override (a ``selection`` there runs with its parameters under that config:
        :func:`~kvrag.engine.reuse.selection.configured_params`)."""
        selection = fields.pop("selection", None) or config.selection
        base = dict(
            selection=selection,
            params=configured_params(config, selection).resolved(n_layers),
            capture_block=config.prefix_block_tokens,
        )
        return cls(**{**base, **fields})


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


def _captures(adapter: ModelAdapter, plan: Plan, options: PrefillOptions) -> tuple[KVCapture | None, dict]:
    """The prefix-cache capture (its reused partial block copied in) and the missed chunks' captures.

    One capture per range: merging them into one cost more (measured: a capture past glibc's mmap
    threshold, ~32 MB, is mapped afresh and page-faults on every request; chunk-sized ones reuse
    the heap)."""
    capture = None
    if options.capture_end > plan.prefix_len:
        cap_start = plan.prefix_len - plan.prefix_len % options.capture_block
        capture = KVCapture(adapter, cap_start, options.capture_end)
        if cap_start < plan.prefix_len:  # the reused partial block: copy it from its record
            start, rec = plan.prefix_records[-1]
            a = cap_start - start
            capture.k[:, :, : plan.prefix_len - cap_start] = rec.k[:, :, a:].to(adapter.dtype)
            capture.v[:, :, : plan.prefix_len - cap_start] = rec.v[:, :, a:].to(adapter.dtype)
    chunk_caps = {}
    cached_spans = [(s, s + r.num_tokens) for s, r in plan.exact_records + plan.chunk_records]
    for i in options.capture_chunks:  # only chunks computed whole, on every layer
        seg = plan.segments[i]
        if seg.start >= plan.prefix_len and not any(a < seg.end and seg.start < b for a, b in cached_spans):
            chunk_caps[i] = KVCapture(adapter, seg.start, seg.end)
    return capture, chunk_caps


def prefill(
    adapter: ModelAdapter,
    plan: Plan,
    capacity: int,
    *,
    options: PrefillOptions,
    pause: Callable[[], None] | None = None,
) -> PrefillResult:
    """Compute the KV of a plan's prompt into a new buffer of ``capacity`` positions.

    By the plan's path: ``full`` computes every row; ``prefix`` and ``reuse`` compute the rows
    without cached KV; ``blend`` hands the prefill to the selection strategy of
    ``options.selection`` (:mod:`kvrag.engine.reuse.selection`). ``pause`` reaches every layer pass
    (:func:`~kvrag.engine.model.runner.forward`).
    """
    n = plan.num_tokens
    buf = KVBuffer(adapter, capacity)
    trace = Trace()
    all_pos = torch.arange(n, device=adapter.device)
    ids = torch.tensor(plan.ids, dtype=torch.long, device=adapter.device)  # [N]
    capture, chunk_caps = _captures(adapter, plan, options)
    captures = ([capture] if capture is not None else []) + list(chunk_caps.values())
    middles = [m for c in chunk_caps.values() for m in block_middles(c.start, c.end, STATS_STRIDE)]
    tap = Tap(sorted(middles), adapter.n_layers) if middles else None
    taps = [tap] if tap is not None else []

    if plan.is_full or not plan.cached_spans():
        h, _ = forward(
            adapter, buf, ids, all_pos, n, capture=captures, taps=taps, trace=trace, last_row_only=True, pause=pause
        )
        return PrefillResult(buf, h[-1:], trace, 0, n, capture, chunk_caps, dict.fromkeys(chunk_caps, tap))

    source = SpanSource(adapter, plan.cached_spans(), adapter.rope(all_pos), n)
    candidates = span_mask(n, plan.blended_spans(), adapter.device)  # [N] blended chunk KV: may be recomputed
    rows = ~span_mask(n, plan.exact_spans(), adapter.device)  # [N] not reused exactly
    measured: dict = {}
    kept_taps = dict.fromkeys(chunk_caps, tap)
    if plan.path == "blend" and plan.ratio > 0 and plan.chunk_records:
        params = options.params if options.params is not None else selection_params(options.selection)
        options = dataclasses.replace(options, params=params.resolved(adapter.n_layers))
        blend = BlendPass(
            adapter=adapter, plan=plan, buf=buf, ids=ids, all_pos=all_pos, rows=rows, candidates=candidates,
            spans=plan.blended_spans(), source=source, captures=captures,
            taps=taps, trace=trace, options=options, pause=pause,
        )  # fmt: skip
        h, pos = get_selection(options.selection)(blend)
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
    return PrefillResult(buf, h[-1:], trace, recomputed, computed, capture, chunk_caps, kept_taps, measured)


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


def generation_stats(plan: Plan, res: PrefillResult, n_layers: int, prefill_s: float) -> GenerationStats:
    """What a prefill did, for :attr:`Generation.stats`."""
    n = plan.num_tokens
    full_work = n * n_layers
    blended = sum(r.num_tokens for _, r in plan.chunk_records)
    return GenerationStats(
        mode=plan.mode,
        path=plan.path,
        path_reason=plan.reason,
        recompute_ratio=(res.recomputed_tokens / blended if blended else 0.0) if plan.auto else plan.ratio,
        auto=plan.auto,
        selection=plan.selection if plan.path == "blend" else "",
        prompt_tokens=n,
        cached_tokens=plan.cached_tokens,
        prefix_tokens=plan.prefix_len,
        exact_tokens=plan.exact_tokens,
        recomputed_tokens=res.recomputed_tokens,
        computed_tokens=res.computed_tokens,
        compute_fraction=res.trace.token_layers / full_work if full_work else 0.0,
        chunk_hits=sum(c.hit for c in plan.chunks),
        chunk_misses=sum(not c.hit for c in plan.chunks),
        chunks_found=sum(c.found for c in plan.chunks),
        chunks=[ChunkInfo(c.start, c.length, c.hit, c.source, c.tier, c.fix, c.overlap) for c in plan.chunks],
        prefill_s=prefill_s,
    )
