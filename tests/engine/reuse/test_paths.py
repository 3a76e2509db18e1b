"""The cost model's choice of a plan's path, over plans of token ids and small records: no model.

A plan whose reuse cannot beat a full prefill (nothing cached, too little, or what the engine has
learned the path costs) runs as a full prefill or with exact KV only; one that wins keeps its path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvrag.engine.reuse.budget import Budget
from kvrag.engine.reuse.paths import CPU_BLEND_LINE, LEARN_WINDOW, MARGIN, PathCosts
from kvrag.engine.reuse.planner import Plan
from kvrag.engine.reuse.segments import prompt_ids
from kvrag.engine.reuse.variants import ExactDigest, context_id
from tests.engine.reuse.test_planner import LEAD, QUESTION, make_planner, prompt, record

LAYERS = 2  # the pretend model's (test_planner.KV_SHAPE)
BUDGET = Budget("probe", 0.15)


@dataclass
class Paths:
    """The cost model and the budget a plan is priced with (what the prefill hands the cost model)."""

    costs: PathCosts
    budget: Budget = BUDGET

    def choose(self, plan: Plan, *, price: bool = True) -> Plan:
        return self.costs.settle(plan, self.budget, price=price)


def priced() -> PathCosts:
    """A cost model that prices these small plans (a real one keeps short prompts on their mode's path)."""
    return PathCosts(LAYERS, min_tokens=1)


def docs(n: int, size: int = 40) -> list[list[int]]:
    return [list(range(1000 + 100 * i, 1000 + 100 * i + size)) for i in range(n)]


def plan_with(cached: int, of: int, *, mode: str = "blend", ratio: float = 0.15, costs: PathCosts | None = None):
    """A blend plan over ``of`` chunks of which the first ``cached`` are stored (computed elsewhere)."""
    planner, variants = make_planner()
    paths = Paths(costs if costs is not None else priced(), Budget("probe", ratio))
    chunks = docs(of)
    for d in chunks[:cached]:
        variants.keep(planner.chunk_key(d), record(d), ())
    segments = prompt(("text", LEAD), *(("chunk", d) for d in chunks), ("text", QUESTION))
    return paths, planner.plan(segments, mode=mode, full=paths.budget.reuses_nothing(mode), use_prefix=False)


def test_nothing_cached_runs_a_full_prefill():
    planner, plan = plan_with(0, 6)
    planner.choose(plan)
    assert (plan.path, plan.reason) == ("full", "nothing cached")
    assert plan.mode == "blend"  # what the request asked for (its write-back follows it)
    assert not any(u.hit or u.found for u in plan.chunks)


def test_a_mode_that_reuses_nothing_is_full_as_requested():
    planner, plan = plan_with(3, 6, ratio=1.0)
    planner.choose(plan)
    assert (plan.path, plan.reason) == ("full", "requested") and plan.cached_spans() == []


def test_too_little_cached_falls_back_to_full_and_keeps_what_was_found():
    # one chunk of six blended at 15%: the plan computes 1 - 40 * 0.85 / 249 = 0.86 of a full prefill,
    # within the margin; the chunk is computed (a miss to write back) but reported as found
    planner, plan = plan_with(1, 6)
    assert planner.costs.price(plan, "blend", planner.budget).cost == pytest.approx(1 - 40 * 0.85 / plan.num_tokens)
    planner.costs.margin = 0.15
    planner.choose(plan)
    assert plan.path == "full" and plan.reason.startswith("blend predicted 0.86")
    assert plan.cached_spans() == [] and plan.cached_tokens == 0
    first = plan.chunks[0]
    assert (first.hit, first.source, first.found, first.tier, first.fix) == (False, "computed", True, "", None)


def test_enough_cached_keeps_the_blend():
    planner, plan = plan_with(5, 6)
    planner.choose(plan)
    assert plan.path == "blend" and plan.reason.startswith("predicted")
    assert len(plan.chunk_records) == 5 and sum(u.hit for u in plan.chunks) == 5


def test_a_path_must_win_by_the_margin():
    # a share whose blend saves just under the margin runs full; just over, blend
    n = plan_with(1, 1)[1].num_tokens
    saved = 40 * 0.85 / n
    for margin, path in ((saved + 0.01, "full"), (saved - 0.01, "blend")):
        planner, plan = plan_with(1, 1)
        planner.costs.margin = margin
        assert planner.choose(plan).path == path


def test_exact_kv_alone_is_reused_when_blending_the_rest_does_not_win():
    planner, variants = make_planner()
    chunks = docs(4)
    segments = prompt(("text", LEAD), *(("chunk", d) for d in chunks), ("text", QUESTION))
    exact = ExactDigest([t for s in segments for t in s.ids])
    for i, d in enumerate(chunks[:3]):  # the first three computed in this very prompt: exact variants
        before = tuple(context_id(c) for c in chunks[:i])
        variants.keep(planner.chunk_key(d), record(d), before, exact.at(segments[i + 1].start))
    variants.keep(planner.chunk_key(chunks[3]), record(chunks[3]), ())  # the last one from elsewhere
    paths = Paths(PathCosts(LAYERS, prior={"blend": (0.5, 1.0)}, min_tokens=1))  # blending is dear here
    plan = planner.plan(segments, mode="blend", use_prefix=False)
    assert len(plan.exact_records) == 3 and len(plan.chunk_records) == 1
    paths.choose(plan)
    assert plan.path == "prefix" and plan.reason.startswith("blend predicted")
    assert [u.source for u in plan.chunks] == ["tree", "tree", "tree", "computed"]
    assert plan.chunk_records == [] and plan.exact_tokens == 120


def test_a_tiny_exact_prefix_is_not_worth_its_overhead():
    # a plan whose only reuse is a few exact tokens: predicted within the margin of a full prefill
    planner, plan = plan_with(0, 6)
    plan.prefix_len, plan.prefix_records = 4, [(0, record(LEAD[:4]))]
    assert planner.costs.price(plan, "prefix", planner.budget).cost > 1 - MARGIN
    planner.choose(plan)
    assert plan.path == "full" and plan.prefix_len == 0 and plan.prefix_records == []


def test_short_prompts_keep_their_modes_path():
    planner, plan = plan_with(1, 6, costs=PathCosts(LAYERS, min_tokens=plan_with(1, 6)[1].num_tokens + 1))
    planner.costs.margin = 0.5  # would lose by far if it were priced
    assert planner.choose(plan).path == "blend" and plan.reason == "requested"


def observe_blends(costs: PathCosts, segments, a: float, m: float, times: int) -> None:
    """``times`` blends over ``segments`` whose seconds follow ``a + m * work`` (a full prefill: 1 s)."""
    n = len(prompt_ids(segments))
    costs.observe(Plan(mode="full", segments=segments), BUDGET, n * LAYERS, 1.0)
    for i in range(times):
        work = (0.3, 0.7)[i % 2]
        blend = Plan(mode="blend", segments=segments)
        costs.observe(blend, BUDGET, round(work * n * LAYERS), a + m * work)


def test_the_prior_line_holds_until_the_path_is_timed():
    costs = PathCosts(LAYERS, prior={"blend": CPU_BLEND_LINE}, min_tokens=1)
    planner, plan = plan_with(2, 6, costs=costs)  # a third of the prompt cached: 0.73 of the work
    work = 1 - 80 * 0.85 / plan.num_tokens
    assert costs.price(plan, "blend", BUDGET).cost == pytest.approx(CPU_BLEND_LINE[0] + CPU_BLEND_LINE[1] * work)
    assert planner.choose(plan).path == "full"
    # blends on this engine cost no more than their work: the fit leaves the prior
    planner, blended = plan_with(2, 6, costs=costs)
    observe_blends(costs, blended.segments, 0.0, 1.0, LEARN_WINDOW)
    assert costs.price(blended, "blend", BUDGET).cost < 1 - MARGIN
    assert planner.choose(blended).path == "blend"
    assert costs.stats()["lines"]["blend"]["observations"] == LEARN_WINDOW


def test_the_line_is_learned_from_prefills_against_full_ones():
    costs = PathCosts(LAYERS, min_tokens=100)
    planner, plan = plan_with(3, 6, costs=costs)
    work = 1 - 120 * 0.85 / plan.num_tokens
    assert costs.price(plan, "blend", BUDGET).cost == pytest.approx(work)  # no prior: the work alone
    observe_blends(costs, plan.segments, 0.6, 1.0, 4 * LEARN_WINDOW)  # blends that cost their work + 0.6
    a, m = costs._lines["blend"].fit()
    assert m == pytest.approx(1.0, abs=0.05) and 0.45 < a < 0.6  # the data, with the prior's weight of two
    assert planner.choose(plan).path == "full"  # 0.59 of the work + ~0.5 is no win


def test_short_prefills_teach_nothing():
    costs = PathCosts(LAYERS)  # default: prefills under LEARN_MIN_TOKENS tokens are not timed
    _, plan = plan_with(3, 6, costs=costs)
    observe_blends(costs, plan.segments, 5.0, 1.0, 2)
    assert costs.full.observations == 0 and costs.stats()["lines"] == {}


def test_auto_expects_the_recompute_share_it_measured():
    costs = PathCosts(LAYERS, min_tokens=1)
    _, plan = plan_with(3, 6, ratio=0.3, costs=costs)
    auto = Budget("probe", 0.3, auto=True)
    assert costs.recompute_share(auto) == 0.3  # before any measure: the cap
    costs.observe(plan, auto, plan.num_tokens, 1.0, recomputed=12)  # 12 of the 120 blended tokens
    assert costs.recompute_share(auto) == pytest.approx(0.1)


def test_off_the_requested_path_runs_whenever_anything_is_cached():
    planner, plan = plan_with(1, 6, costs=PathCosts(LAYERS, enabled=False))
    planner.costs.margin = 0.5
    planner.choose(plan)
    assert (plan.path, plan.reason) == ("blend", "requested") and len(plan.chunk_records) == 1
    planner, plan = plan_with(0, 6, costs=PathCosts(LAYERS, enabled=False))
    assert planner.choose(plan).path == "full"
    # a measurement of the mode itself (calibration) asks for its path unpriced
    planner, plan = plan_with(1, 6)
    planner.costs.margin = 0.5
    assert planner.choose(plan, price=False).path == "blend"


def test_fall_back_refuses_a_path_that_reuses_more():
    _, plan = plan_with(1, 6)
    with pytest.raises(ValueError):
        plan.fall_back("blend", "no")
