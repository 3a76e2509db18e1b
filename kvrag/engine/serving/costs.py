"""What prefills cost, fed back: the engine's own cost profile, PGDSF's miss costs, the cost model
that picks each plan's path (:mod:`kvrag.engine.reuse.paths`), and CacheBlend's loading controller
(§5.1) raising the recompute ratio while recompute hides under loading from a slower tier."""

from __future__ import annotations

from kvrag.engine.reuse.budget import Budget
from kvrag.engine.reuse.paths import CPU_BLEND_LINE, PathCosts
from kvrag.engine.reuse.planner import Plan
from kvrag.engine.store.base import KVStore
from kvrag.engine.store.prefetch import LoadingController, ThroughputMeter
from kvrag.engine.store.profile import CostProfile

__all__ = ["CostFeedback"]


class CostFeedback:
    """Args: the engine's store, its model's layer count, whether the loading controller is on,
    whether plans are priced (``EngineConfig.cost_model``), the model's device type (the path
    costs' prior)."""

    def __init__(
        self, store: KVStore, n_layers: int, loading_controller: bool, cost_model: bool = True, device: str = "cpu"
    ) -> None:
        self.store, self.n_layers, self.enabled = store, n_layers, loading_controller
        self.profile = CostProfile()  # this engine's own prefill times
        # what each path costs against a full prefill: the planner asks it for each plan's path
        prior = {"blend": CPU_BLEND_LINE} if device == "cpu" else {}
        self.paths = PathCosts(n_layers, enabled=cost_model, prior=prior)
        self.loading = LoadingController(getattr(store, "meter", None) or ThroughputMeter())

    def loading_budget(self, plan: Plan, budget: Budget) -> Budget:
        """The budget a blend prefill runs with: ``budget``, its share raised while recompute hides
        under loading the plan's KV from a slower tier."""
        if not self.enabled or plan.path != "blend":
            return budget
        streaming = [  # disk or remote hits, still streaming in
            r for _, r in plan.exact_records + plan.chunk_records if hasattr(r, "pending_bytes")
        ]
        if not any(r.pending_bytes() for r in streaming):
            return budget
        t_full = self.profile.full_prefill(plan.num_tokens, self.n_layers)
        return budget.raised(self.loading.ratio_for_records(budget.share, streaming, t_full))

    def observe(self, plan: Plan, budget: Budget, token_layers: int, seconds: float, recomputed: int = 0) -> None:
        """After a prefill: feed the cost profile and the path costs, and tell the store what its
        misses cost (PGDSF)."""
        cached = plan.cached_tokens
        self.profile.record(cached, plan.num_tokens - cached, seconds, token_layers)
        self.paths.observe(plan, budget, token_layers, seconds, recomputed)
        if plan.mode in ("blend", "reuse"):
            missed = [c.key for c in plan.chunks if c.source == "computed"]
            per_token = self.profile.seconds_per_token(cached, plan.num_tokens - cached)
            if missed and per_token:
                self.store.record_cost(missed, per_token)
