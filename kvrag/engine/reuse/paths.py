"""Which path a prefill takes: reuse is run only where the cost model says it wins.

Reusing cached KV is not free. The rows a blend computes are spread along the prompt, so their
attention runs in masked blocks instead of one causal pass; a probe measures before it chooses;
cached KV is rotated into place layer by layer. With little of the prompt cached, that costs more
than it saves (on this CPU a blend with one or two cached chunks of six cost more than the full
prefill). So a plan is priced before it runs, against the paths that reuse less:

- ``full``: every token computed: the reference, cost 1;
- ``prefix``: only exact KV reused (the exact prefix, exact chunk variants): the full prefill's
  numbers for ``(n - exact) / n`` of its work;
- ``blend`` / ``reuse``: the plan as made (blended chunk hits, the conversation's shifted history).

A path's predicted cost, relative to a full prefill of the same prompt, is a line in its *work*
(the share of a full prefill's token-layers it computes): ``a + m * work``, per path, fitted online
by least squares: after each prefill of at least :data:`LEARN_MIN_TOKENS` tokens, its seconds over
a full prefill's of that length (:class:`~kvrag.engine.store.profile.CostProfile` of the full
prefills this engine ran) against its work, recent prefills weighing most (:data:`LEARN_WINDOW`).
A prior line, worth two prefills (at work 0.25 and 0.75), holds the fit until there are data and
keeps it from tilting on data of one kind: on a CPU, blend's is :data:`CPU_BLEND_LINE` (measured);
otherwise the work alone (``a = 0, m = 1``). A path that reuses more is taken only when predicted
at least :data:`MARGIN` cheaper than the best path that reuses less: the full prefill is exact, so
a tie goes to it. Prompts shorter than :data:`LEARN_MIN_TOKENS` keep their mode's path: there the
prices are unknown, and the choice costs milliseconds either way. Plain Python over plans: testable
without a model.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrag.engine.store.profile import CostProfile

if TYPE_CHECKING:
    from kvrag.engine.reuse.budget import Budget
    from kvrag.engine.reuse.planner import Plan

__all__ = ["PathCosts", "Price", "CostLine", "MARGIN", "LEARN_MIN_TOKENS", "LEARN_WINDOW", "CPU_BLEND_LINE"]

#: A path that reuses more is taken only if predicted this much cheaper (share of a full prefill).
MARGIN = 0.05

#: Shorter prefills teach the cost model nothing: fixed per-call costs dominate them.
LEARN_MIN_TOKENS = 1024

#: The fits weigh about this many recent prefills (older ones fade geometrically).
LEARN_WINDOW = 8

#: Blend's cost on a CPU before this engine has timed its own, ``(a, m)``: TTFT / full TTFT =
#: a + m * work. Fitted to 17 blends of the bundled model in bfloat16 on this project's 2-core
#: machine (3.6K-token prompts, 1 to 6 of 6 chunks cached): 0.21 + 1.26 * work.
CPU_BLEND_LINE = (0.2, 1.25)


@dataclass(frozen=True, slots=True)
class Price:
    """A path's predicted cost for one plan, relative to a full prefill of the same prompt."""

    path: str
    work: float  # share of a full prefill's token-layers it computes
    cost: float  # predicted seconds / a full prefill's


class CostLine:
    """``cost = a + m * work``, fitted by weighted least squares (not thread-safe: PathCosts locks).

    Args:
        prior: ``(a, m)`` before any data, worth one observation at work 0.25 and one at 0.75.
    """

    PRIOR_AT = (0.25, 0.75)

    def __init__(self, prior: tuple[float, float] = (0.0, 1.0)) -> None:
        a, m = prior
        self._prior = [(w, a + m * w) for w in self.PRIOR_AT]
        self._sums = [0.0] * 5  # observations' weighted n, sum w, sum c, sum w^2, sum w*c
        self.observations = 0

    def add(self, work: float, cost: float) -> None:
        keep = 1.0 - 1.0 / LEARN_WINDOW
        self._sums = [x * keep for x in self._sums]
        for i, x in enumerate((1.0, work, cost, work * work, work * cost)):
            self._sums[i] += x
        self.observations += 1

    def fit(self) -> tuple[float, float]:
        """``(a, m)`` of the data and the prior."""
        n, sw, sc, sww, swc = self._sums
        for w, c in self._prior:
            n, sw, sc, sww, swc = n + 1, sw + w, sc + c, sww + w * w, swc + w * c
        m = (n * swc - sw * sc) / (n * sww - sw * sw)  # > 0 denominator: the prior's two works differ
        return (sc - m * sw) / n, m

    def cost(self, work: float) -> float:
        a, m = self.fit()
        return a + m * work


class PathCosts:
    """The cost model of prefill paths (thread-safe).

    Args:
        n_layers: the model's layers (a plan's work is counted in token-layers).
        enabled: price plans (``EngineConfig.cost_model``); off, a plan keeps its mode's path
            whenever anything is cached.
        prior: each path's ``(a, m)`` before it is observed (default ``(0, 1)``: its work).
        margin: see :data:`MARGIN`.
        min_tokens: see :data:`LEARN_MIN_TOKENS`.
    """

    def __init__(
        self,
        n_layers: int,
        *,
        enabled: bool = True,
        prior: Mapping[str, float] | None = None,
        margin: float = MARGIN,
        min_tokens: int = LEARN_MIN_TOKENS,
    ) -> None:
        self.n_layers, self.enabled, self.margin, self.min_tokens = n_layers, enabled, margin, min_tokens
        self.full = CostProfile()  # seconds of the full prefills this engine ran
        self._priors = dict(prior or {})
        self._lines: dict[str, CostLine] = {}  # path -> its cost line
        self._recompute: tuple[float, int] = (0.0, 0)  # share of blended tokens an ``auto`` blend recomputed
        self._lock = threading.Lock()

    # -- prediction ------------------------------------------------------------------------------

    def _line(self, path: str) -> CostLine:
        line = self._lines.get(path)
        if line is None:
            line = self._lines[path] = CostLine(self._priors.get(path, (0.0, 1.0)))
        return line

    def recompute_share(self, budget: Budget) -> float:
        """The share of its blended tokens a blend is expected to recompute: the budget's share; with
        ``auto`` the mean measured so far, within the budget's cap (the cap before any)."""
        if not budget.auto:
            return budget.share
        with self._lock:
            mean, count = self._recompute
        return min(budget.share, mean) if count else budget.share

    def price(self, plan: Plan, path: str, budget: Budget) -> Price:
        """What running ``plan`` as ``path`` is predicted to cost (``full``, ``prefix``, or the plan's own)."""
        n = plan.num_tokens
        if path == "full" or n == 0:
            return Price("full", 1.0, 1.0)
        exact = plan.exact_tokens
        blended = sum(r.num_tokens for _, r in plan.chunk_records)
        if path == "prefix":
            computed = n - exact
        elif path == "reuse":
            computed = n - exact - blended
        else:  # blend
            computed = n - exact - blended * (1.0 - self.recompute_share(budget))
        work = max(computed, 1) / n
        with self._lock:
            return Price(path, work, self._line(path).cost(work))

    def settle(self, plan: Plan, budget: Budget, *, price: bool = True) -> Plan:
        """Settle the path ``plan`` runs (:meth:`choose`): a plan whose reuse is not predicted to win
        falls back to ``prefix`` or ``full``. Call it once what the plan reuses is complete (a
        conversation's KV attached). Returns the plan."""
        path, reason = self.choose(plan, budget, price=price)
        if path != plan.path:
            plan.fall_back(path, reason)
        else:
            plan.reason = reason
        return plan

    def choose(self, plan: Plan, budget: Budget, *, price: bool = True) -> tuple[str, str]:
        """The path ``plan`` should run with ``budget`` and why: ``(path, reason)``.

        ``full`` when nothing is cached (or the plan reuses nothing); otherwise, for a prompt of at
        least ``min_tokens``, the cheapest of ``full``, ``prefix`` (when exact KV is cached) and the
        plan's own path, a path that reuses more taken only when predicted :data:`MARGIN` cheaper
        than the best before it. ``price=False`` keeps the plan's own path whenever anything is
        cached (a measurement of that path, e.g. calibration).
        """
        if plan.is_full:
            return "full", "requested"
        if not plan.cached_spans():
            return "full", "nothing cached"
        if not (self.enabled and price) or plan.num_tokens < self.min_tokens:
            return plan.path, "requested"
        own = plan.path if plan.chunk_records else "prefix"  # without blended KV, only exact KV is reused
        best = self.price(plan, "full", budget)
        for path in dict.fromkeys(["prefix", own] if plan.exact_tokens else [own]):
            price = self.price(plan, path, budget)
            if price.cost <= best.cost - self.margin:
                best = price
        if best.path == own:
            return own, f"predicted {best.cost:.2f} of a full prefill"
        return best.path, f"{own} predicted {self.price(plan, own, budget).cost:.2f} of a full prefill"

    # -- learning --------------------------------------------------------------------------------

    def observe(self, plan: Plan, budget: Budget, token_layers: int, seconds: float, recomputed: int = 0) -> None:
        """A prefill ran ``plan`` with ``budget``: ``token_layers`` computed in ``seconds``, ``recomputed``
        blended tokens recomputed through the last layer."""
        n = plan.num_tokens
        if n < self.min_tokens or not seconds > 0:
            return
        if plan.path == "full":
            self.full.record(0, n, seconds, token_layers)
            return
        blended = sum(r.num_tokens for _, r in plan.chunk_records)
        with self._lock:
            if plan.path == "blend" and budget.auto and blended:
                self._recompute = _mean(self._recompute, recomputed / blended)
        reference = self.full.full_prefill(n, self.n_layers) if self.full.observations else None
        if not reference:  # no full prefill seen yet: nothing to compare with
            return
        with self._lock:
            self._line(plan.path).add(token_layers / (n * self.n_layers), seconds / reference)

    def stats(self) -> dict:
        """What the model has learned: each path's line (``a``, ``m``) and observations, ``auto``'s
        recompute share."""
        with self._lock:
            lines = {p: (line.fit(), line.observations) for p, line in self._lines.items()}
            return {
                "lines": {p: {"a": a, "m": m, "observations": c} for p, ((a, m), c) in lines.items()},
                "auto_recompute": self._recompute[0] if self._recompute[1] else None,
                "full_prefills": self.full.observations,
            }


def _mean(state: tuple[float, int], value: float) -> tuple[float, int]:
    """A running mean over about the last :data:`LEARN_WINDOW` values."""
    mean, count = state
    count += 1
    return mean + (value - mean) / min(count, LEARN_WINDOW), count
