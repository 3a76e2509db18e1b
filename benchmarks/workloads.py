"""Workloads: how requests are made and which methods run them, interleaved per request.

This module runs (a) and (b) and holds what every workload shares (the run's context, method
order, result rows, warming); (c) and (r) live in modules of their own, and the registry of
names is :data:`benchmarks.run.WORKLOADS`.

(a) ``questions``: one request per dataset question, its top-k passages pre-warmed (the CacheBlend
    setting) in dataset order, then asked in the request's order (shuffled by default); with
    ``warm_company="other"`` each passage is pre-warmed behind passages of other questions instead.
    Every method runs on a request before the next request starts, so each method's figures pair
    with ``full``'s on the same request.
(b) ``stream``: a pooled Zipf stream over all passages of the questions, against a store bounded
    below the working set. No pre-warming: misses are computed and written back as a server would.
    Each method that uses the store gets its own engine (same weights) and store, so one method's
    cache never serves another's requests.
(c) ``conversations``: multi-turn conversations through the engine's conversation API
    (:mod:`benchmarks.conversations`).
(r) ``retrieval``: a retrieval corpus, questions asked in sequence and coming back reworded, each
    method on a store of its own (:mod:`benchmarks.retrieval`). New workloads register a runner
    in :data:`benchmarks.run.WORKLOADS`.

Methods that write whole prompts into the exact-prefix cache (``prefix``) run last on a request:
otherwise a later method would find the very same prompt cached and reuse it exactly. Timing
repeats of a question therefore use a fresh passage order each (see ``--repeat``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from benchmarks.data import PromptFormat, QAItem, Request, request_order
from benchmarks.engines import MethodEngines
from benchmarks.methods import Method, Outcome, ttft_ratios
from benchmarks.metrics import FP32_FULL, best_f1, best_rouge_l, first_word_agreement, rouge_l
from benchmarks.metrics import drift as answer_drift
from kvrag.engine.types import WarmResult
from kvrag.errors import InvalidRequestError

__all__ = [
    "RunContext",
    "run_questions",
    "run_stream",
    "ordered",
    "make_record",
    "answer_drift",
    "WARMUP_TEXT",
]

WARMUP_TEXT = ("This text warms the benchmark up; it is not part of any dataset. " * 12) + "\n\n"


@dataclass
class RunContext:
    """Everything a workload needs: the engine, the methods, the options, where records go."""

    engine: object
    methods: list[Method]
    fmt: PromptFormat
    run_id: str
    options: dict
    records: list[dict] = field(default_factory=list)
    extras: dict = field(default_factory=dict)  # per-workload facts (store budgets, pools, ...)
    progress: Callable | None = None  # tqdm-like factory: progress(iterable, desc=..., total=...)
    method_engines: MethodEngines | None = None  # an engine per method over the run's store (built on demand)
    load: Callable | None = None  # load(config, store): the run's model in another dtype (MethodEngines)
    checkpoint: Callable[[], None] | None = None  # writes the records so far (a long workload's parts)

    def opt(self, name: str, default=None):
        return self.options.get(name, default)

    def engine_for(self, method: Method):
        """The engine ``method`` runs on where the methods share the run's store (workloads a, c)."""
        if self.method_engines is None:
            self.method_engines = MethodEngines(self.engine, self.load)
        return self.method_engines.shared(method)

    def close(self) -> None:
        """Release the engines built for methods (not the run's engine)."""
        if self.method_engines is not None:
            self.method_engines.close()


def ordered(methods: list[Method]) -> list[Method]:
    """``full`` first (the reference), then the other full prefills (another dtype or chunk order: the
    references of the methods like them), exact-prefix writers last, the rest as given."""
    full = [m for m in methods if m.name == "full"]
    refs = [m for m in methods if m.name != "full" and getattr(m, "mode", None) == "full"]
    rest = [m for m in methods if m not in full and m not in refs and not m.exact_prefix_writer]
    return full + refs + rest + [m for m in methods if m.exact_prefix_writer and m.name != "full"]


def make_record(
    run_id: str, req: Request, method: Method, out: Outcome, ref: Outcome | None, *, name: str | None = None
) -> dict:
    """One result row: timings, engine facts, fidelity against ``ref`` (full) and the gold answers.

    ``name`` files the row under another name than the method's (a stream's ``blend/pgdsf``).
    """
    rec = {
        "run_id": run_id,
        "workload": req.workload,
        "request": req.request,
        "repeat": req.repeat,
        "method": name or method.name,
        "question": req.question,
        "order": req.order,
        "ttft_s": out.ttft_s,
        "total_s": out.total_s,
        "text": out.text,
        "completion_tokens": len(out.token_ids),
        "prompt_tokens": out.prompt_tokens,
        "cached_tokens": out.cached_tokens,
        "recomputed_tokens": out.recomputed_tokens,
        "recompute_fraction": out.recomputed_tokens / out.candidate_tokens if out.candidate_tokens else None,
        "compute_fraction": out.compute_fraction,
        "chunk_hits": out.chunk_hits,
        "chunk_misses": out.chunk_misses,
        "chunks": (out.chunk_hits + out.chunk_misses) or len(req.chunks),
        **out.extra,
    }
    if ref is not None and ref is not out:
        rec["ttft_ratio_full"] = out.ttft_s / ref.ttft_s if ref.ttft_s else None
        rec["total_ratio_full"] = out.total_s / ref.total_s if ref.total_s else None
        rec["prompt_tokens_match_full"] = out.prompt_tokens == ref.prompt_tokens
        if out.token_ids and ref.token_ids:
            rec["first_token_agree_full"] = out.token_ids[0] == ref.token_ids[0]
    if out.text is not None:
        rec["f1_gold"] = best_f1(out.text, req.answers)
        rec["rouge_l_gold"] = best_rouge_l(out.text, req.answers)
        if ref is not None and ref is not out and ref.text is not None:
            rec["rouge_l_full"] = rouge_l(out.text, ref.text)
            rec["first_word_agree_full"] = first_word_agreement(out.text, ref.text)
            rec["identical_full"] = out.token_ids == ref.token_ids
    return rec


def warm_in_dataset_order(engine, item: QAItem, order: list[int]):
    """Warm a request's passages in retrieval (dataset) order; the request asks them in ``order``.

    A chunk's cached KV is then computed behind the passages before it in retrieval order (and the
    list's last ones), not behind its neighbours in the prompt (which would flatter the fusion).
    """
    warm = engine.warm([item.passages[i] for i in sorted(order)])
    engine.flush()
    return warm


def warm_in_other_company(
    engine, item: QAItem, order: list[int], pool: list[str], others: int, rng: random.Random, prefix: str = ""
):
    """Warm each of a request's passages on its own behind ``others`` passages of other questions.

    A shared store fills with chunks first computed for other requests, in other company; this is
    that case (``--warm-company other``): no passage of the request is behind another of its
    passages. The store is emptied first, so nothing an earlier request computed is found; then
    the prompt's lead text ``prefix`` (instructions, the same in every request) is cached again,
    as every earlier request leaves it with ``warm_company="request"``. Otherwise the first
    method after ``full`` would pay for computing it and the later ones would not.
    """
    engine.store.clear()
    if prefix:
        engine.generate(prefix=prefix, mode="prefix", max_new_tokens=1)
    mine = set(item.passages)
    strangers = [p for p in dict.fromkeys(pool) if p not in mine]
    if len(strangers) < others:
        raise InvalidRequestError(
            f"--warm-company other needs {others} passages of other questions; "
            f"the dataset has {len(strangers)} (raise --n or lower --warm-others)"
        )
    results = [engine.warm(rng.sample(strangers, others) + [item.passages[i]]) for i in sorted(order)]
    engine.flush()
    return WarmResult(
        sum(r.computed for r in results),
        sum(r.cached for r in results),
        sum(r.tokens for r in results),
        sum(r.seconds for r in results),
    )


def _warmup(ctx: RunContext) -> None:
    """Run every method once on a throw-away request (first-call allocations are not measured)."""
    item = QAItem(-1, "What does this text do?", ["warms up"], [WARMUP_TEXT])
    req = ctx.fmt.request(item, [0], workload="warmup", request=-1)
    ctx.engine.warm(req.chunks)
    for m in ordered(ctx.methods):
        engine = ctx.engine_for(m)
        m.run(engine, req, max_new_tokens=2)
        engine.flush()


def run_questions(ctx: RunContext, items: list[QAItem]) -> list[dict]:
    """Workload (a): per question, chunks pre-warmed, every method on every request."""
    engine, methods = ctx.engine, ordered(ctx.methods)
    top_k, repeat = ctx.opt("top_k", 6), ctx.opt("repeat", 1)
    shuffle = ctx.opt("order", "shuffled") == "shuffled"
    if repeat > 1 and not shuffle and any(m.exact_prefix_writer for m in methods):
        raise InvalidRequestError(
            "--repeat > 1 with --order given would let the prefix cache of one repeat serve the next "
            "(same prompt twice); use --order shuffled (each repeat gets a fresh order) or drop 'prefix'"
        )
    score_set = set(ctx.opt("score_methods") or [])
    max_new = ctx.opt("max_new_tokens", 32)
    rng = random.Random(ctx.opt("seed", 0))
    company, others = ctx.opt("warm_company", "request"), ctx.opt("warm_others", 3)
    company_rng = random.Random(ctx.opt("seed", 0) + 1)  # the passage orders stay those of company="request"
    pool = [p for it in items for p in it.passages[:top_k]] if company == "other" else []
    _warmup(ctx)
    jobs = [(item, r) for item in items for r in range(repeat)]
    out: list[dict] = []
    bar = ctx.progress(jobs, desc="(a) questions", total=len(jobs)) if ctx.progress else jobs
    used: set[tuple] = set()
    for item, r in bar:
        order = request_order(len(item.passages), top_k, shuffle, rng)
        for _ in range(100):  # a repeat never sees an order it saw before (prefix cache: see above)
            if not shuffle or (item.index, tuple(order)) not in used:
                break
            order = request_order(len(item.passages), top_k, shuffle, rng)
        used.add((item.index, tuple(order)))
        req = ctx.fmt.request(item, order, workload="questions", request=item.index, repeat=r)
        if company == "other":
            warm = warm_in_other_company(engine, item, order, pool, others, company_rng, req.prefix)
        else:
            warm = warm_in_dataset_order(engine, item, order)
        outcomes: dict[str, Outcome] = {}
        scores: dict[str, float | None] = {}
        drifts: dict[str, list[float] | None] = {}
        for m in methods:
            eng = ctx.engine_for(m)
            outcomes[m.name] = m.run(eng, req, max_new_tokens=max_new)
            eng.flush()  # write-back off the clock, before the next method is timed
            if m.answers and m.name in score_set:
                scores[m.name] = m.score(eng, req, req.answers[0])
                full_answer = outcomes["full"].text  # full runs first (see ordered)
                if full_answer and full_answer.strip():
                    drifts[m.name] = m.score_tokens(eng, req, full_answer)
                eng.flush()
        ref = outcomes["full"]
        for m in methods:
            rec = make_record(ctx.run_id, req, m, outcomes[m.name], ref)
            rec["warm_computed"] = warm.computed
            if m.name in scores:
                rec["gold_logprob"] = scores[m.name]
                if scores.get("full") is not None and scores[m.name] is not None:
                    rec["delta_logprob_full"] = scores[m.name] - scores["full"]
            if m.name != "full" and drifts.get(m.name) and drifts.get("full"):
                rec["answer_drift_full"] = answer_drift(drifts[m.name], drifts["full"])
            fp32 = drifts.get(FP32_FULL[1])
            if m.name != FP32_FULL[1] and drifts.get(m.name) and fp32 and rec.get("dtype") != "float32":
                # the same full answer under the float32 full prefill: a bf16 method's distance from
                # the exacter computation (bf16's own rounding included), beside its distance from bf16 full
                rec["answer_drift_fp32_full"] = answer_drift(drifts[m.name], fp32)
            out.append(rec)
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(ttft_ratios(outcomes))
    ctx.records.extend(out)
    return out


# -- (b) a pooled Zipf stream ----------------------------------------------------------------------


def kv_shape(engine) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the engine's model."""
    cfg = engine.hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(engine) -> int:
    """Bytes of one token's KV at the engine's dtype (keys + values over all layers) + its id."""
    layers, kv_heads, head_dim = kv_shape(engine)
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[engine.config.dtype]
    return 2 * layers * kv_heads * head_dim * elem + 8


def zipf_requests(items: list[QAItem], n_requests: int, top_k: int, s: float, seed: int) -> tuple[list, dict]:
    """Requests over a pooled passage set; passage popularity follows Zipf(s) over a random ranking.

    Each request draws ``top_k`` distinct passages by popularity (in drawn order) and asks the
    question of the first drawn passage's item. Returns ([(item, [pool ids])...], pool facts).
    """
    pool: list[str] = []
    owner: list[int] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        for text in item.passages:
            if text not in seen:
                seen[text] = len(pool)
                pool.append(text)
                owner.append(i)
    if len(pool) < top_k:
        raise InvalidRequestError(f"the stream's pool has {len(pool)} passages, fewer than top-k={top_k}")
    rng = np.random.default_rng(seed)
    rank = rng.permutation(len(pool))  # rank[p] = popularity rank of passage p
    weights = 1.0 / np.power(rank + 1.0, s)
    weights /= weights.sum()
    reqs = []
    for _ in range(n_requests):
        picks = [int(x) for x in rng.choice(len(pool), size=top_k, replace=False, p=weights)]
        reqs.append((items[owner[picks[0]]], picks))
    return reqs, {"pool": pool, "owner": owner}


def run_stream(ctx: RunContext, items: list[QAItem]) -> list[dict]:
    """Workload (b): a Zipf stream against a bounded store; hit rate and speed-up over time.

    ``--eviction-policy lru,pgdsf`` runs every store-using method once per policy, side by side on
    the same requests (rows filed as ``blend/lru``, ``blend/pgdsf``), each with its own store.
    """
    base = ctx.engine
    methods = ordered(ctx.opt("stream_methods") or ctx.methods)
    if not any(m.name == "full" for m in methods):
        raise InvalidRequestError("the stream workload needs 'full' among its methods (ratios are against it)")
    policies = [p.strip() for p in str(ctx.opt("eviction_policy", "lru")).split(",") if p.strip()]
    top_k, n_req = ctx.opt("top_k", 6), ctx.opt("stream_requests", 30)
    reqs, pool = zipf_requests(items, n_req, top_k, ctx.opt("zipf", 1.0), ctx.opt("seed", 0))
    per_token = kv_bytes_per_token(base)
    tokens = [base.count_tokens(t) for t in pool["pool"]]
    pool_bytes = sum(tokens) * per_token
    touched = {p for _, picks in reqs for p in picks}
    budget = ctx.opt("stream_budget_bytes") or int(pool_bytes * ctx.opt("stream_budget_frac", 0.25))
    overrides = dict(memory_budget_bytes=int(budget))
    if base.config.disk_tier:  # bounded too: as many bytes as memory (at fp16 rest: twice the tokens)
        overrides["disk_budget_bytes"] = int(ctx.opt("stream_disk_budget_bytes") or budget)
    engines = MethodEngines(base, ctx.load)
    try:
        runners = engines.runners(methods, {p: dict(overrides, eviction_policy=p) for p in policies})
        owned = engines.owned
        ctx.extras["stream"] = {
            "requests": n_req,
            "pool_passages": len(pool["pool"]),
            "pool_kv_bytes": pool_bytes,
            "working_set_passages": len(touched),
            "working_set_kv_bytes": sum(tokens[p] for p in touched) * per_token,
            "kv_bytes_per_token": per_token,
            "zipf_s": ctx.opt("zipf", 1.0),
            "store": dict(overrides, eviction_policy=",".join(policies), disk_tier=bool(base.config.disk_tier)),
            "store_types": {k: type(e.store).__name__ for k, e in owned.items()},
        }
        out: list[dict] = []
        bar = ctx.progress(range(n_req), desc="(b) stream", total=n_req) if ctx.progress else range(n_req)
        max_new = ctx.opt("stream_max_new_tokens", 8)
        for j in bar:
            item, picks = reqs[j]
            req = Request(
                "stream",
                j,
                0,
                ctx.fmt.head,
                [pool["pool"][p] for p in picks],
                f"{ctx.fmt.question_head}{item.question}{ctx.fmt.tail}",
                item.question,
                item.answers,
                order=picks,
            )
            outcomes = {}
            for name, m, eng in runners:
                outcomes[name] = m.run(eng, req, max_new_tokens=max_new)
                eng.flush()
            for name, m, eng in runners:
                rec = make_record(ctx.run_id, req, m, outcomes[name], outcomes["full"], name=name)
                if name in owned:
                    rec.update(store_usage(eng.store.stats()))
                out.append(rec)
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(ttft_ratios(outcomes))
        ctx.extras["stream"]["refresh"] = {name: dict(e.writeback.refresh_counts) for name, e in owned.items()}
        ctx.records.extend(out)
        return out
    finally:
        engines.close()


def store_usage(stats: dict) -> dict:
    """Bytes held and budgets of a store's tiers, from its stats (memory-only or tiered)."""
    mem = stats.get("memory", stats)
    disk = stats.get("disk") or {}
    out = {
        "memory_bytes": mem.get("bytes"),
        "memory_budget_bytes": mem.get("budget_bytes"),
        "memory_evictions": mem.get("evictions"),
        "speculative_refused": mem.get("speculative_refused"),
    }
    if disk:
        out.update(
            disk_bytes=disk.get("bytes"),
            disk_budget_bytes=disk.get("budget_bytes"),
            disk_evictions=disk.get("evictions"),
        )
    return out
