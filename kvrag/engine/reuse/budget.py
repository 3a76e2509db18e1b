"""The recompute budget of a blend: one immutable value per request.

A request asks for a ``recompute_ratio`` (a share of the cached chunk tokens, or ``"auto"``), a
``selection`` and a ``quality``. :func:`kvrag.engine.serving.requests.resolve_budget` turns them,
with the engine's settings, into a :class:`Budget` once, when the request is validated. The
planner, the cost model and fusion read it; none of them writes it back. Two later decisions
derive a new value from it instead: :meth:`Budget.for_plan` (the other-context rule, once the
planner knows in what context the prompt's chunk KV was computed) and :meth:`Budget.raised`
(CacheBlend's loading controller, while recompute hides under loading from a slower tier).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrag.engine.reuse.planner import Plan

__all__ = ["Budget", "OtherContextRule", "NO_RECOMPUTE"]


@dataclass(frozen=True, slots=True)
class OtherContextRule:
    """What ``"auto"`` runs when the prompt's chunk KV was computed in another context.

    Attributes:
        selection: the selection run then (``ReuseSettings.other_context_selection``).
        own: share of a chunk whose KV was computed in the context that precedes it here.
        other: share of a chunk whose KV was computed behind other passages.
        below: the prompt counts as "another context" when the overlap of its blended chunks
            (Cache-Craft's beta, averaged over their tokens) is below this.
    """

    selection: str
    own: float
    other: float
    below: float


@dataclass(frozen=True, slots=True)
class Budget:
    """What a ``blend`` prefill recomputes of the cached chunk tokens.

    Attributes:
        selection: the registered selection strategy that picks the tokens.
        share: the share of the blended tokens recomputed; with ``auto``, the most.
        auto: recompute what the selection measures is needed (blocks whose deviation reaches
            ``threshold``), up to ``share``.
        threshold: the deviation from which ``auto`` recomputes a block.
        other_context: the rule :meth:`for_plan` applies (None: none applies).
    """

    selection: str
    share: float
    auto: bool = False
    threshold: float | None = None
    other_context: OtherContextRule | None = None

    def reuses_nothing(self, mode: str) -> bool:
        """Every token is computed: ``full`` mode, or ``blend`` at a fixed share of 1.0."""
        return mode == "full" or (mode == "blend" and not self.auto and self.share >= 1.0)

    def for_plan(self, plan: Plan) -> Budget:
        """The budget a planned ``blend`` runs with: itself, or where the plan's blended chunk KV was
        computed in another context (the other-context rule), the rule's selection at a share
        summed chunk by chunk (``own`` or ``other`` of each chunk's tokens by its own overlap)."""
        rule = self.other_context
        if rule is None or plan.path != "blend":
            return self
        overlap = plan.context_overlap()
        if overlap is None or overlap >= rule.below:
            return self
        return Budget(rule.selection, plan.dial_share(rule.own, rule.other, rule.below))

    def raised(self, share: float) -> Budget:
        """This budget with its share raised to ``share`` (never lowered)."""
        return self if share <= self.share else dataclasses.replace(self, share=share)


#: The budget of a prefill that recomputes no cached token (``reuse``, an exact refresh, the gate).
NO_RECOMPUTE = Budget("probe", 0.0)
