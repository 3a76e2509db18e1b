"""The registry of selection strategies and what a strategy sees of a blend prefill.

A *selection strategy* decides which cached chunk tokens a ``blend`` prefill recomputes, and runs
the layer passes that recompute them. It receives a :class:`BlendPass` (the plan, the KV buffer,
the cached KV source, the rows that must be computed anyway) and returns the hidden state of the
prompt's last row and the positions computed through the last layer. Strategies are looked up by
name (:func:`get_selection`); new ones plug in with :func:`register_selection` and a name in
:data:`kvrag.config.SELECTIONS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.runner import KVBuffer, KVCapture, QueryTap, Selector, Trace, forward
from kvrag.engine.reuse.attention_stats import STATS_STRIDE, Tap, block_middles

if TYPE_CHECKING:
    from kvrag.engine.reuse.fusion import PrefillOptions
    from kvrag.engine.reuse.planner import Plan, SpanSource

__all__ = ["BlendPass", "Strategy", "register_selection", "get_selection", "registered_selections", "auto_kind"]


@dataclass(slots=True, kw_only=True)
class BlendPass:
    """One ``blend`` prefill as a selection strategy sees it.

    Attributes:
        adapter: the model.
        plan: the request's plan (``plan.ratio`` is the recompute budget's share of cached tokens).
        buf: the request's KV buffer (cached KV enters it layer by layer through ``source``).
        ids: [N] prompt token ids, on the model's device.
        all_pos: [N] positions 0..N-1.
        rows: [N] bool, positions after the exact prefix: what is not reused exactly.
        candidates: [N] bool, positions holding cached chunk KV (the ones a strategy may recompute).
        spans: [(start, end)] of the cached chunks, in prompt order.
        source: cached KV of the plan, placed at its positions per layer.
        captures: KV captures the prefill must feed (prefix cache, missed chunks).
        taps: query taps the prefill must feed (the missed chunks' attention statistics).
        trace: rows computed per layer.
        options: the prefill's options (selection parameters).
        measured: what the strategy measured, for calibration and benchmarks (e.g. the probe's
            ``block_sizes`` and ``block_deviation``, [B] each).
        kept: start -> (KV capture, query tap) of cached chunks the strategy recomputes whole,
            kept as new variants computed in this prompt's company (:meth:`keep_whole`).
        pause: the engine thread's pause hook, passed to every pass (see :func:`~kvrag.engine.model.runner.forward`).
    """

    adapter: ModelAdapter
    plan: Plan
    buf: KVBuffer
    ids: torch.Tensor
    all_pos: torch.Tensor
    rows: torch.Tensor
    candidates: torch.Tensor
    spans: list[tuple[int, int]]
    source: SpanSource
    captures: list[KVCapture]
    taps: list[QueryTap]
    trace: Trace
    options: PrefillOptions
    measured: dict = field(default_factory=dict)
    kept: dict[int, tuple[KVCapture, Tap]] = field(default_factory=dict)
    pause: Callable[[], None] | None = None

    def keep_whole(self, start: int, end: int) -> None:
        """Keep the KV of the cached chunk at [start, end), which the strategy recomputes whole on
        every layer from now on, as a variant of that chunk computed in this prompt's company
        (with its attention statistics). Call before the passes that recompute it."""
        if not self.options.keep_recomputed:
            return
        cap = KVCapture(self.adapter, start, end)
        tap = Tap(block_middles(start, end, STATS_STRIDE), self.adapter.n_layers)
        self.captures.append(cap)
        self.taps.append(tap)
        self.kept[start] = (cap, tap)

    @property
    def uncached(self) -> torch.Tensor:
        """[N] bool: rows that are always computed (uncached text, the question)."""
        return self.rows & ~self.candidates

    def run(
        self,
        pos: torch.Tensor,
        *,
        hidden: torch.Tensor | None = None,
        selector: Selector | None = None,
        layers: tuple[int, int] | None = None,
        last_row_only: bool = False,
        record: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~kvrag.engine.model.runner.forward` over rows ``pos`` [R] of this prompt.

        Args:
            hidden: [R, E] hidden states to resume from instead of embedding the rows' ids.
            record: feed the captures and the trace (off for a probe whose rows are not kept).
        """
        return forward(
            self.adapter,
            self.buf,
            self.ids[pos] if hidden is None else None,
            pos,
            self.plan.num_tokens,
            source=self.source,
            selector=selector,
            capture=self.captures if record else (),
            taps=self.taps if record else (),
            trace=self.trace if record else None,
            hidden=hidden,
            layers=layers,
            last_row_only=last_row_only,
            pause=self.pause,
        )


#: Runs a blend prefill; returns (hidden [1, E] of the last row, positions [R] computed through the last layer).
Strategy = Callable[[BlendPass], tuple[torch.Tensor, torch.Tensor]]

_STRATEGIES: dict[str, Strategy] = {}
_AUTO: dict[str, str] = {}
#: How a strategy spends ``recompute_ratio="auto"``: ``"threshold"`` measures a deviation and
#: recomputes what reaches the model's calibrated threshold; ``"self"`` decides on its own (e.g.
#: from the variants' fix overhead). Either way within the cap (``plan.auto``, ``plan.ratio``).
AUTO_KINDS = ("threshold", "self")


def register_selection(name: str, strategy: Strategy, *, auto: str | None = None) -> Strategy:
    """Make ``strategy`` available as ``selection=name`` (the name must be in ``kvrag.config.SELECTIONS``).

    ``auto``: how it spends ``recompute_ratio="auto"`` (one of :data:`AUTO_KINDS`); ``None``: it
    takes a fixed share (``config.auto_ratio``).
    """
    from kvrag.config import SELECTIONS

    if name not in SELECTIONS:
        raise ValueError(f"selection {name!r} is not in kvrag.config.SELECTIONS; add it there (validation, docs)")
    if auto is not None and auto not in AUTO_KINDS:
        raise ValueError(f"auto must be one of {AUTO_KINDS} or None, got {auto!r}")
    _STRATEGIES[name] = strategy
    if auto is not None:
        _AUTO[name] = auto
    return strategy


def auto_kind(name: str) -> str | None:
    """How the strategy ``name`` spends an ``auto`` budget (:data:`AUTO_KINDS`), or None."""
    return _AUTO.get(name)


def get_selection(name: str) -> Strategy:
    """The strategy registered as ``name``."""
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise ValueError(f"no selection strategy {name!r}; registered: {', '.join(sorted(_STRATEGIES))}") from None


def registered_selections() -> tuple[str, ...]:
    return tuple(sorted(_STRATEGIES))
