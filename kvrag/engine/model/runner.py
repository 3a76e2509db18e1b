"""Layer-wise execution over any subset of a sequence's tokens.

One function, :func:`forward`, serves every path: full prefill (all rows), exact prefix reuse
(rows after the cached prefix), CacheBlend fusion (cached chunk KV loaded per layer, rows pruned
by a selector), full reuse (only uncached rows), decoding (one row) and scoring (a few rows).
A pass can run a range of layers and another resume from its hidden states: the probe selection
runs some rows to a middle layer, decides, and joins them with the rows it chose.

The KV of a sequence lives in a preallocated :class:`KVBuffer`; keys there carry their layer's
RoPE for their position. Sliding-window layers attend to the last ``window`` keys only. Cached KV
enters through a :class:`KVSource`, one layer at a time, just before that layer runs (so a slower
tier can prefetch layer l+1 while layer l computes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.kernels import attention

__all__ = ["KVBuffer", "KVSource", "Selector", "QueryTap", "KVCapture", "Trace", "forward"]


class KVBuffer:
    """K/V of one sequence, preallocated: ``k``/``v`` [L, Hkv, capacity, D]; keys carry RoPE."""

    def __init__(self, adapter: ModelAdapter, capacity: int) -> None:
        shape = (adapter.n_layers, adapter.n_kv_heads, capacity, adapter.head_dim)
        self.k = torch.empty(shape, dtype=adapter.dtype, device=adapter.device)
        self.v = torch.empty(shape, dtype=adapter.dtype, device=adapter.device)
        self.capacity = capacity
        self.length = 0  # positions [0, length) hold valid KV

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def grow(self, capacity: int) -> None:
        """Enlarge the buffer (keeps the first ``length`` positions)."""
        if capacity <= self.capacity:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], capacity, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = capacity


class KVSource(Protocol):
    """Supplies cached KV, layer by layer."""

    def fill(self, layer: int, buf: KVBuffer) -> None:
        """Write this layer's cached K (rotated to its positions) and V into ``buf``."""

    def overwritten(self, layer: int, pos: torch.Tensor) -> None:
        """The pass computed rows ``pos`` [R] on this layer: their fresh KV replaced what :meth:`fill`
        put there (a later pass over the layer must put back what it still needs)."""


class Selector(Protocol):
    """Decides, on some layers, which computed rows go on being computed."""

    def wants(self, layer: int) -> bool:
        """Whether :meth:`select` runs on this layer."""

    def select(self, layer: int, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buf: KVBuffer):
        """Given this layer's fresh q [H, R, D], k [Hkv, R, D] (both with RoPE) and v [Hkv, R, D]
        of rows at ``pos`` [R] (the buffer still holds the cached KV there), return the indices of
        rows to keep, or None."""


class QueryTap(Protocol):
    """Sees every layer's queries (with RoPE) of the rows a pass computes."""

    def observe(self, layer: int, pos: torch.Tensor, q: torch.Tensor) -> None:
        """q [H, R, D] of rows at ``pos`` [R] on ``layer``."""


class KVCapture:
    """Keeps the fresh pre-RoPE K and V of positions [start, end) as they are computed.

    Kept token-major ([L, T, Hkv, D]: the layout the K and V projections write, so each layer's
    copy is contiguous; a head-major copy of it is a strided gather, ~2-4x slower) and turned
    head-major ([L, Hkv, T, D], what records hold) when first read: after the request's first token.

    ``values_in``: the buffer a pass computing every row of the range writes (a full prefill). V
    carries no RoPE, so the buffer holds exactly what a copy would; :attr:`v` is then read from it
    when first asked (write-back), not copied inside the pass.

    ``extra_end``: positions [end, extra_end) are kept too, by the same copies (the text after a
    chunk, up to the next one: :meth:`part` gives it, :attr:`k` and :attr:`v` do not), so a pass
    keeps them without an operation more per layer."""

    def __init__(
        self,
        adapter: ModelAdapter,
        start: int,
        end: int,
        *,
        values_in: KVBuffer | None = None,
        extra_end: int | None = None,
    ) -> None:
        self.start, self.end = start, end
        self.extra_end = end if extra_end is None else max(end, extra_end)
        shape = (adapter.n_layers, self.extra_end - start, adapter.n_kv_heads, adapter.head_dim)  # token-major
        self._k = torch.empty(shape, dtype=adapter.dtype, device=adapter.device)
        self._values_in = values_in
        self._v = None if values_in is not None else torch.empty(shape, dtype=adapter.dtype, device=adapter.device)
        self._k_tm, self._v_tm = True, values_in is None  # still token-major
        self._parts: tuple[torch.Tensor, torch.Tensor] | None = None  # (k, v) of [start, end) once split off
        self._rows: torch.Tensor | None = None  # the scattered rows last looked at, and which of them are kept
        self._sel: torch.Tensor | None = None
        #: (slice size, end[, prompt length]): a prefill in fixed slices computed it, its KV below
        #: ``end`` what any such prefill computes there (:mod:`kvrag.engine.reuse.slices`); None: a
        #: pass of another shape
        self.slices: tuple[int, ...] | None = None

    def _keys(self) -> torch.Tensor:
        """[L, Hkv, extra_end - start, D]: every kept key (made head-major once)."""
        if self._k_tm:
            self._k, self._k_tm = self._k.transpose(1, 2).contiguous(), False
        return self._k

    def _values(self) -> torch.Tensor:
        """[L, Hkv, extra_end - start, D]: every kept value (made head-major once; a view of the
        pass's buffer, if given one)."""
        if self._v is None:
            return self._values_in.v[:, :, self.start : self.extra_end]
        if self._v_tm:
            self._v, self._v_tm = self._v.transpose(1, 2).contiguous(), False
        return self._v

    @property
    def k(self) -> torch.Tensor:
        """[L, Hkv, end - start, D]: the keys (without RoPE)."""
        if self.extra_end == self.end:
            return self._keys()
        return self._split()[0]

    @property
    def v(self) -> torch.Tensor:
        """[L, Hkv, end - start, D]: the values (read from the pass's buffer the first time, if given one)."""
        if self.extra_end == self.end:
            if self._v is None:  # read from the pass's buffer once
                self._v, self._values_in = self._values().clone(), None
            return self._values()
        return self._split()[1]

    def _split(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._parts is None:
            n = self.end - self.start
            self._parts = (self._keys()[:, :, :n].clone(), self._values()[:, :, :n].clone())
        return self._parts

    def part(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [L, Hkv, b - a, D] of kept positions [a, b) (within [start, extra_end)), copied."""
        if not self.start <= a <= b <= self.extra_end:
            raise ValueError(f"[{a}, {b}) is not within the captured [{self.start}, {self.extra_end})")
        i, j = a - self.start, b - self.start
        return self._keys()[:, :, i:j].clone(), self._values()[:, :, i:j].clone()

    def take(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> None:
        """Keep the captured positions' K/V of one layer; ``rows``: the host's facts about ``pos``."""
        start, end = self.start, self.extra_end
        # token-major: the rows [R, Hkv, D] go to [T, Hkv, D]; head-major (read already): [Hkv, R, D] to [Hkv, T, D]
        kept = [(self._k[layer], k.transpose(0, 1) if self._k_tm else k, 0 if self._k_tm else 1)]
        if self._v is not None:
            kept.append((self._v[layer], v.transpose(0, 1) if self._v_tm else v, 0 if self._v_tm else 1))
        if rows.contiguous:  # rows are positions [first, last]: slice, no masks
            a, b = max(start, rows.first), min(end, rows.last + 1)
            if a < b:
                for dst, src, dim in kept:
                    _serial_copy(dst, dim, a - start, src, a - rows.first, b - a)
            return
        if self._rows is not pos:  # the same rows in every layer until a selector drops some: look once
            sel = (pos >= start) & (pos < end)
            self._rows, self._sel = pos, (None if not bool(sel.any()) else sel)
        if self._sel is not None:
            idx = pos[self._sel] - start
            for dst, src, dim in kept:
                if dim == 0:
                    dst[idx] = src[self._sel]
                else:
                    dst[:, idx] = src[:, self._sel]


#: Elements a copy runs on one thread (torch's intra-op grain size: a larger copy is split over the
#: pool, and a few-row copy inside a prefill then waits ~50 us on the other threads, measured: 4x
#: the copy itself; a capture takes a few such copies per layer).
_SERIAL_ELEMENTS = 32768


def _serial_copy(dst: torch.Tensor, dim: int, at: int, src: torch.Tensor, src_at: int, n: int) -> None:
    """``dst.narrow(dim, at, n).copy_(src.narrow(dim, src_at, n))``, in pieces small enough to run
    on the calling thread alone."""
    per_row = dst.numel() // max(1, dst.shape[dim])
    step = max(1, (_SERIAL_ELEMENTS - 1) // max(1, per_row))
    for i in range(0, n, step):
        m = min(step, n - i)
        dst.narrow(dim, at + i, m).copy_(src.narrow(dim, src_at + i, m))


@dataclass(frozen=True, slots=True)
class Rows:
    """What the host knows of a pass's row positions (strictly increasing), read from the device
    once per set of rows: on a GPU each read waits for every queued kernel, and the layers of a pass
    share their rows until a selector drops some."""

    first: int
    last: int
    contiguous: bool

    @classmethod
    def of(cls, pos: torch.Tensor) -> Rows:
        if pos.numel() == 0:
            return cls(0, -1, False)
        first, last = pos[[0, -1]].tolist()  # one read
        return cls(first, last, last - first + 1 == pos.numel())

    @property
    def span(self) -> tuple[int, int] | None:
        """(first, last) for :func:`kvrag.kernels.attention`, None without rows."""
        return (self.first, self.last) if self.last >= self.first else None


@dataclass(slots=True)
class Trace:
    """What a forward pass computed: rows per layer."""

    rows_per_layer: list[int] = field(default_factory=list)

    @property
    def token_layers(self) -> int:
        return sum(self.rows_per_layer)


def _write(dst: torch.Tensor, pos: torch.Tensor, src: torch.Tensor, rows: Rows) -> None:
    """dst [Hkv, S, D][:, pos] = src [Hkv, R, D]."""
    if rows.contiguous:
        dst[:, rows.first : rows.last + 1] = src
    else:
        dst[:, pos] = src


@torch.inference_mode()
def forward(
    adapter: ModelAdapter,
    buf: KVBuffer,
    ids: torch.Tensor | None,
    pos: torch.Tensor,
    seq_len: int,
    *,
    source: KVSource | None = None,
    selector: Selector | None = None,
    capture: list[KVCapture] | tuple = (),
    taps: list[QueryTap] | tuple = (),
    trace: Trace | None = None,
    hidden: torch.Tensor | None = None,
    layers: tuple[int, int] | None = None,
    last_row_only: bool = False,
    pause: Callable[[], None] | None = None,
    split_tail: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run layers for the rows ``ids`` [R] at positions ``pos`` [R] (strictly increasing).

    Positions [0, seq_len) not among the rows must have their KV in ``buf`` already or be filled
    by ``source``. Rows attend causally to every position before them.

    A selector that keeps no rows ends the pass after writing that layer's KV (a probe).

    Args:
        taps: keep the queries (with RoPE) of some positions as they are computed (attention statistics).
        hidden: [R, E] the rows' hidden state entering the first layer of ``layers``, instead of
            embedding ``ids`` (a pass that resumes another one).
        layers: (first, stop) the layers run; all of them by default.
        last_row_only: on the model's last layer compute every row's KV but only the last row's
            output (a prefill needs only the last token's logits; nothing reads the other rows').
        split_tail: rows after cached keys attend as two fused calls merged by log-sum-exp
            (:func:`~kvrag.kernels.reference.tail_attention`: a deterministic prefill's slices).
        pause: called after each layer's attention and after its MLP: the engine thread runs other
            requests' decode steps there (:mod:`kvrag.engine.serving.worker`); it may raise to end the pass.

    Returns:
        (hidden [R', E], pos [R']) of the rows still computed, entering layer ``stop`` (after the
        model's last layer: its output; with ``last_row_only`` hidden is the last row's [1, E]).
    """
    first, stop = layers if layers is not None else (0, adapter.n_layers)
    h = adapter.embed(ids) if hidden is None else hidden
    rope = adapter.rope(pos)
    rows = Rows.of(pos)
    masks: dict = {}  # window -> attention masks of the current rows, shared by the layers of that window
    for layer in range(first, stop):
        if source is not None:
            source.fill(layer, buf)
        q, k, v = adapter.qkv(layer, h)
        for cap in capture:
            cap.take(layer, pos, k, v, rows)
        cos, sin = rope.layer(layer)
        k = adapter.apply_rope(k, cos, sin)
        q = adapter.apply_rope(q, cos, sin)
        for tap in taps:
            tap.observe(layer, pos, q)
        keep = selector.select(layer, pos, q, k, v, buf) if selector is not None and selector.wants(layer) else None
        _write(buf.k[layer], pos, k, rows)
        _write(buf.v[layer], pos, v, rows)
        if source is not None:
            source.overwritten(layer, pos)
        if keep is not None and keep.numel() == 0:  # no row goes on: the pass ends at this layer's KV
            return h[:0], pos[:0]
        if keep is not None and keep.numel() != pos.numel():
            q, h, pos, rope = q[:, keep], h[keep], pos[keep], rope[keep]
            rows, masks = Rows.of(pos), {}
        if trace is not None:
            trace.rows_per_layer.append(int(pos.numel()))
        q_pos, span = pos, rows.span
        if last_row_only and layer == adapter.n_layers - 1:
            q, h, q_pos, masks, span = q[:, -1:], h[-1:], pos[-1:], {}, (rows.last, rows.last)
        window = adapter.windows[layer]
        kv = buf.k[layer, :, :seq_len], buf.v[layer, :, :seq_len]
        out = attention(
            q, q_pos, *kv, adapter.scale, masks.setdefault(window, {}), window=window, span=span, split_tail=split_tail
        )
        if pause is not None:
            pause()
        h = adapter.finish_layer(layer, h, out)
        if pause is not None:
            pause()
    if stop == adapter.n_layers:
        buf.length = max(buf.length, seq_len)
    return h, pos
