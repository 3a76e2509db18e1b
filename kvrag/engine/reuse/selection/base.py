"""The registry of selection strategies and what a strategy sees of a blend prefill.

A *selection strategy* decides which cached chunk tokens a ``blend`` prefill recomputes, and runs
the layer passes that recompute them. It receives a :class:`BlendPass` (the plan, the KV buffer,
the cached KV source, the rows that must be computed anyway, its parameters) and returns the hidden
state of the prompt's last row and the positions computed through the last layer.

The registry is the one list of selections: a strategy is added in one file, by calling
:func:`register_selection` with its name, its parameters class (a :class:`SelectionParams`) and how
it spends ``recompute_ratio="auto"``. Everything else reads the registry: the engine checks
``EngineConfig.selection`` (and its ``selection_params``) when it is built and each request's
``selection=`` when it arrives; the integrations and the server pass the name through as a string.
The product's strategies (``probe``, ``recency``) register when :mod:`kvrag.engine.reuse.selection`
is imported; research baselines, ablations and oracles register from ``benchmarks/``
(``benchmarks.selections``) when the benchmarks are imported, through this same API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.runner import KVBuffer, KVCapture, QueryTap, Selector, Trace, forward
from kvrag.engine.reuse.attention_stats import STATS_STRIDE, Tap, block_middles
from kvrag.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvrag.config import EngineConfig
    from kvrag.engine.reuse.budget import Budget
    from kvrag.engine.reuse.placement import SpanSource
    from kvrag.engine.reuse.planner import Plan

__all__ = [
    "BlendPass",
    "PrefillOptions",
    "Strategy",
    "SelectionParams",
    "DEVIATIONS",
    "check_deviation",
    "register_selection",
    "get_selection",
    "check_selection",
    "registered_selections",
    "params_class",
    "selection_params",
    "configured_params",
    "auto_kind",
    "AUTO_KINDS",
]

#: What a per-token KV deviation compares: keys, values, or the sum of both.
DEVIATIONS = ("k", "v", "kv")


def check_deviation(value) -> str:
    """Validate a ``deviation`` parameter (one of :data:`DEVIATIONS`)."""
    if value not in DEVIATIONS:
        raise InvalidRequestError(f"deviation must be one of {DEVIATIONS}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class SelectionParams:
    """The parameters of a selection strategy; this base class has none (``recency``).

    A strategy with parameters registers a frozen slotted subclass whose fields have defaults and
    whose ``__post_init__`` raises :class:`~kvrag.errors.InvalidRequestError` on a bad value, so a
    bad setting fails when the engine is built, not in the middle of a prefill. Parameters that
    depend on the model (a layer chosen as a share of the depth) are settled by :meth:`resolved`.
    """

    def resolved(self, n_layers: int) -> SelectionParams:
        """The parameters for a model of ``n_layers`` layers (defaults that depend on the depth settled)."""
        return self

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The parameters' names."""
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillOptions:
    """How one prefill runs, besides its plan: the selection strategy, its parameters, what to capture.

    Attributes:
        params: the strategy's parameters (its registered :class:`SelectionParams` subclass);
            ``None``: its defaults. :func:`prefill` resolves them for the model before the strategy
            sees them (``BlendPass.params``).
        capture_end: > 0 keeps the exact pre-RoPE KV of [aligned prefix_len, capture_end) for the
            prefix cache.
        capture_block: the prefix cache's block size (the capture starts on a block boundary).
        capture_chunks: segment indices of missed chunks whose KV, computed whole in this prompt,
            is kept (write-back of their real context).
        keep_recomputed: keep cached chunks a strategy recomputes whole as new variants.
        capture_tail: keep the prompt's tail (after its last chunk) when the whole prompt is computed
            exactly (:attr:`PrefillResult.tail`; the planner's ``Plan.tail``).
        slice_tokens: > 0 runs a prefill with nothing blended in fixed slices of this many rows, so that
            exact reuse gives the full prefill's bits (:mod:`kvrag.engine.reuse.slices`); 0: one pass.
    """

    params: SelectionParams | None = None
    capture_end: int = 0
    capture_block: int = 16
    capture_chunks: tuple[int, ...] = ()
    keep_recomputed: bool = False
    capture_tail: bool = False
    slice_tokens: int = 0

    @classmethod
    def from_config(cls, config: EngineConfig, n_layers: int, selection: str | None = None, **fields) -> PrefillOptions:
        """Options from an :class:`~kvrag.EngineConfig` for a model of ``n_layers`` layers, with the
        parameters ``selection`` (default ``config.selection``) runs with under that config
        (:func:`configured_params`); ``fields`` override."""
        base = dict(
            params=configured_params(config, selection).resolved(n_layers),
            capture_block=config.prefix_block_tokens,
            slice_tokens=config.deterministic_slice_tokens if config.deterministic else 0,
        )
        return cls(**{**base, **fields})


@dataclass(slots=True, kw_only=True)
class BlendPass:
    """One ``blend`` prefill as a selection strategy sees it.

    Attributes:
        adapter: the model.
        plan: the request's plan.
        budget: what it may recompute (``budget.share`` of the cached tokens; with ``budget.auto``
            what measures reach ``budget.threshold``, up to that share).
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
        options: the prefill's options; ``options.params`` are the strategy's parameters, resolved
            for this model (also :attr:`params`).
        measured: what the strategy measured, for calibration and benchmarks (e.g. the probe's
            ``block_sizes`` and ``block_deviation``, [B] each).
        kept: start -> (KV capture, query tap) of cached chunks the strategy recomputes whole,
            kept as new variants computed in this prompt's context (:meth:`keep_whole`).
        pause: the engine thread's pause hook, passed to every pass (see :func:`~kvrag.engine.model.runner.forward`).
    """

    adapter: ModelAdapter
    plan: Plan
    budget: Budget
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
        every layer from now on, as a variant of that chunk computed in this prompt's context
        (with its attention statistics). Call before the passes that recompute it."""
        if not self.options.keep_recomputed:
            return
        cap = KVCapture(self.adapter, start, end)
        tap = Tap(block_middles(start, end, STATS_STRIDE), self.adapter.n_layers)
        self.captures.append(cap)
        self.taps.append(tap)
        self.kept[start] = (cap, tap)

    @property
    def params(self):
        """The strategy's parameters (its registered :class:`SelectionParams` subclass), resolved for this model."""
        return self.options.params

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


@dataclass(frozen=True, slots=True)
class _Registered:
    strategy: Strategy
    params: type[SelectionParams]
    auto: str | None


_REGISTRY: dict[str, _Registered] = {}
#: How a strategy spends ``recompute_ratio="auto"``: ``"threshold"`` measures a deviation and
#: recomputes what reaches the model's calibrated threshold; ``"self"`` decides on its own (e.g.
#: from the variants' fix overhead). Either way within the cap (``budget.auto``, ``budget.share``).
AUTO_KINDS = ("threshold", "self")


def register_selection(
    name: str,
    strategy: Strategy,
    *,
    params: type[SelectionParams] = SelectionParams,
    auto: str | None = None,
    replace: bool = False,
) -> Strategy:
    """Make ``strategy`` available as ``selection=name``: the one place a selection is declared.

    Args:
        name: the name requests and ``EngineConfig.selection`` use.
        strategy: runs a blend prefill (:data:`Strategy`).
        params: its parameters class (``EngineConfig.selection_params`` are checked by it);
            strategies that measure the same way share one (the benchmarks' ``focus`` and
            ``random`` take the probe's).
        auto: how it spends ``recompute_ratio="auto"`` (one of :data:`AUTO_KINDS`); ``None``: it
            takes a fixed share (``config.auto_ratio``).
        replace: allow registering a name again (a harness re-running in one process).

    Raises:
        ValueError: a bad name, params class or auto kind, or a name already registered.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a selection's name must be an identifier, got {name!r}")
    if not callable(strategy):
        raise ValueError(f"selection {name!r}: the strategy must be callable, got {strategy!r}")
    if not (isinstance(params, type) and issubclass(params, SelectionParams)):
        raise ValueError(f"selection {name!r}: params must be a SelectionParams subclass, got {params!r}")
    if auto is not None and auto not in AUTO_KINDS:
        raise ValueError(f"auto must be one of {AUTO_KINDS} or None, got {auto!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"selection {name!r} is already registered")
    _REGISTRY[name] = _Registered(strategy, params, auto)
    return strategy


def registered_selections() -> tuple[str, ...]:
    """The names of every registered selection, sorted."""
    return tuple(sorted(_REGISTRY))


def check_selection(name) -> str:
    """``name`` if it is a registered selection.

    Raises:
        InvalidRequestError: it is not; the message lists the registered ones.
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise InvalidRequestError(f"unknown selection {name!r}; registered: {', '.join(registered_selections())}")
    return name


def _entry(name: str) -> _Registered:
    return _REGISTRY[check_selection(name)]


def get_selection(name: str) -> Strategy:
    """The strategy registered as ``name`` (:class:`~kvrag.errors.InvalidRequestError` if none is)."""
    return _entry(name).strategy


def auto_kind(name: str) -> str | None:
    """How the strategy ``name`` spends an ``auto`` budget (:data:`AUTO_KINDS`), or None."""
    return _entry(name).auto


def params_class(name: str) -> type[SelectionParams]:
    """The parameters class the selection ``name`` registered."""
    return _entry(name).params


def selection_params(name: str, values: Mapping[str, object] | None = None) -> SelectionParams:
    """The parameters of selection ``name`` from ``values`` (by parameter name; ``None``: the defaults).

    Raises:
        InvalidRequestError: an unknown selection, a name the strategy does not take (the message
            lists the ones it does), or a value its parameters class refuses.
    """
    cls = params_class(name)
    values = dict(values or {})
    unknown = sorted(set(values) - set(cls.names()))
    if unknown:
        takes = ", ".join(cls.names()) or "none"
        raise InvalidRequestError(
            f"selection {name!r} takes no parameter(s) {', '.join(unknown)} (its parameters: {takes})"
        )
    return cls(**values)


def configured_params(config: EngineConfig, name: str | None = None) -> SelectionParams:
    """The parameters selection ``name`` (default ``config.selection``) runs with under ``config``.

    ``config.selection_params`` belong to ``config.selection``, and to every selection registered with
    the same parameters class (``probe`` and the benchmarks' ``focus`` and ``random`` share the
    probe's): a request that switches among those keeps the configured probe. Any other selection
    runs with its defaults.
    Not yet resolved for a model (:meth:`SelectionParams.resolved`).

    Raises:
        InvalidRequestError: an unknown selection, or parameters the configured one refuses.
    """
    configured = selection_params(config.selection, config.selection_params)
    if name is None or params_class(name) is type(configured):
        return configured
    return params_class(name)()
