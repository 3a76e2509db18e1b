"""Workload (r): a retrieval corpus, questions that come back reworded, methods side by side.

The traffic is :mod:`benchmarks.corpus`'s: the first N questions' passages pooled in a faiss
index; a stream of the N first asks and their reworded returns (Zipf popularity over questions);
the top-k passages of each ask, in retrieval order. Questions are asked in sequence. Every method
that uses the store runs on an engine and store of its own (same weights, its own ``+field=value``
overrides), so what the store holds along the stream is that method's own doing; ``full``, the
reference, runs every request on the run's engine. Store modes (``--store``):

- ``corpus``: the whole pool warmed once into each method's store before the first question,
  kvrag's own way (``engine.warm(pool)``), in a stated order (``--corpus-order``: ``shuffled``,
  seeded, by default; ``dataset`` puts each question's passages together, the favourable case).
- ``writeback``: a cold start; chunk KV comes only from what requests write back.

Per request and method (besides :func:`~benchmarks.workloads.make_record`'s fields): the ask
(question, occurrence, wording, passage ids), exact and blended chunks and tokens, the share of
prompt tokens not found in the store (``uncached_share`` = 1 - cached / prompt),
``ttft_excess_full`` = TTFT × full - that share (new passages are computed in full and that part is
not the engine's to save), ``many_hits`` (at least ``--retrieval-min-hits`` chunk hits), and the
answer drift against the full prefill's answer. A method is scored *before* it runs a request:
scoring stores nothing, so its prefill meets the store the run then meets (after the run, the
run's own write-back would be there). When the store holds none of the request's chunks, the
method's prefill is the full prefill's computation: its drift is recorded as 0 without a scoring
prefill (``drift_unscored``).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import replace

from benchmarks.corpus import Ask, Corpus, corpus_order, make_embedder, question_stream
from benchmarks.data import QAItem, Request
from benchmarks.engines import MethodEngines
from benchmarks.methods import Method, Outcome
from benchmarks.metrics import summarize
from benchmarks.workloads import (
    WARMUP_TEXT,
    RunContext,
    answer_drift,
    kv_bytes_per_token,
    make_record,
    ordered,
    store_usage,
)
from kvrag.engine.reuse.access import chunk_key
from kvrag.engine.store.base import KVRecord
from kvrag.errors import InvalidRequestError

__all__ = ["STORE_MODES", "run_retrieval", "retrieval_record"]

STORE_MODES = ("corpus", "writeback")


def run_retrieval(ctx: RunContext, items: list[QAItem]) -> list[dict]:
    """Workload (r) in each store mode of ``ctx.opt("stores")``; rows filed as ``retrieval/<mode>``."""
    k = ctx.opt("top_k", 6)
    min_hits = ctx.opt("retrieval_min_hits") or math.ceil(2 * k / 3)
    if not 1 <= min_hits <= k:
        raise InvalidRequestError(f"--retrieval-min-hits must be in [1, top-k={k}], got {min_hits}")
    seed = ctx.opt("seed", 0)
    corpus = Corpus(items, make_embedder(ctx.opt("embedder", "minilm")))
    asks = question_stream(items, ctx.opt("retrieval_requests") or 2 * len(items), ctx.opt("zipf", 1.0), seed)
    tops = corpus.search([a.text for a in asks], k)
    out: list[dict] = []
    for mode in ctx.opt("stores") or STORE_MODES:
        if mode not in STORE_MODES:
            raise InvalidRequestError(f"--store must name modes of {STORE_MODES}, got {mode!r}")
        out += _run_mode(ctx, items, corpus, list(zip(asks, tops)), mode, min_hits)
        if ctx.checkpoint is not None:  # a later mode's failure keeps this one's records
            ctx.checkpoint()
    return out


def _warm_up(ctx: RunContext, runners: list[tuple[str, Method, object]], owned: dict) -> None:
    """Every engine runs a throw-away request (first-call costs unmeasured); the stores start empty."""
    item = QAItem(-1, "What does this text do?", ["warms up"], [WARMUP_TEXT])
    req = ctx.fmt.request(item, [0], workload="warmup", request=-1)
    for _, m, eng in runners:
        m.run(eng, req, max_new_tokens=2)
        eng.flush()
    for eng in owned.values():
        eng.store.clear()


def _run_mode(ctx: RunContext, items, corpus: Corpus, stream: list[tuple[Ask, list[int]]], mode: str, min_hits: int):
    base = ctx.engine
    methods = ordered(ctx.opt("retrieval_methods") or ctx.methods)
    if not methods or methods[0].name != "full":
        raise InvalidRequestError("workload r needs 'full' among its methods (ratios and drift are against it)")
    score_set = set(ctx.opt("retrieval_score_methods") or [])
    budget = ctx.opt("retrieval_budget_bytes")
    store = {"memory_budget_bytes": int(budget)} if budget else {}
    max_new = ctx.opt("retrieval_max_new_tokens", 32)
    workload = f"retrieval/{mode}"
    same_order = _same_order_refs(methods)
    with MethodEngines(base, ctx.load) as engines:
        runners = engines.runners(methods, {mode: store})
        owned = engines.owned
        _warm_up(ctx, runners, owned)
        warmed = {}
        if mode == "corpus":
            texts, how = corpus_order(corpus, ctx.opt("corpus_order", "similar"), ctx.opt("seed", 0))
            warmed = _warm_stores(engines, owned, texts, how, store, progress=bool(ctx.progress))
        ctx.extras[workload] = _facts(ctx, corpus, stream, mode, min_hits, owned, warmed)
        out: list[dict] = []
        bar = ctx.progress(stream, desc=f"(r) {mode}", total=len(stream)) if ctx.progress else stream
        for ask, top in bar:
            item = items[ask.question]
            req = Request(
                workload,
                ask.position,
                0,
                ctx.fmt.head,
                [corpus.passages[i] for i in top],
                f"{ctx.fmt.question_head}{ask.text}{ctx.fmt.tail}",
                ask.text,
                item.answers,
                order=list(top),
            )
            outcomes: dict[str, Outcome] = {}
            logps: dict[str, list[float] | None] = {}
            # each reordered method's prompt order, from its own chunk-access table before this request
            # counts; its reference full prefill runs in exactly that order, not in one of its own
            orders = {n: _prompt_order(e, m, req) for n, m, e in runners if n in same_order}
            ref_orders: dict[str, tuple[int, ...]] = {}
            for n, perm in orders.items():
                ref_orders.setdefault(same_order[n], perm)
            # a method whose store holds none of the request's chunks reuses no chunk KV: its prefill is
            # the full one's computation, drift 0 without a scoring prefill (nor full's, if none needs it)
            wanted = [(n, m, e) for n, m, e in runners if n != "full" and m.answers and m.name in score_set]
            # a method in another chunk order is also scored against the full prefill in its order
            # (``full+order=frequency``, when run): its drift from reuse alone, the order's taken out;
            # blending nothing, its prefill is that reference's computation, not full's
            own = {n: same_order[n] for n, _, _ in wanted if n in same_order and same_order[n] in score_set}
            lookup = "full" in score_set or own
            blank = {n for n, _, e in wanted if lookup and n in owned and _blends_nothing(e, req)}
            exact = {
                n for n, m, _ in wanted if n in blank and "full" in score_set and getattr(m, "order", None) is None
            }
            scored = {n for n, _, _ in wanted if n not in exact}
            own_exact = blank & set(own)
            own_scored = set(own) - own_exact
            own_refs = {own[n] for n in own_scored}
            own_logps: dict[str, list[float] | None] = {}
            others: dict[tuple[int, ...], tuple[str, list[float] | None]] = {}  # another order's reference
            for name, m, eng in runners:  # full first, then the other full prefills (ordered)
                run_m, run_req = (_as_given(m), _permuted(req, ref_orders[name])) if name in ref_orders else (m, req)
                answer = outcomes["full"].text if outcomes else None
                if answer and answer.strip() and name in scored:
                    logps[name] = run_m.score_tokens(eng, run_req, answer)  # before the run: see the docstring
                if name in own_scored:
                    ref, perm = own[name], orders[name]
                    if perm != ref_orders[ref] and perm not in others:
                        # the reference ran in another method's order: a full prefill in this one's
                        others[perm] = _reference(runners, ref, _permuted(req, perm), max_new)
                    ref_text = outcomes[ref].text if perm == ref_orders[ref] else others[perm][0]
                    if ref_text and ref_text.strip():
                        own_logps[name] = m.score_tokens(eng, req, ref_text)
                outcomes[name] = run_m.run(eng, run_req, max_new_tokens=max_new)
                eng.flush()  # write-back off the clock, before the next method is timed
                text = outcomes[name].text
                if name == "full" and "full" in score_set and scored and text and text.strip():
                    logps[name] = m.score_tokens(eng, req, text)
                if name in own_refs and text and text.strip():
                    own_logps[name] = run_m.score_tokens(eng, run_req, text)
            answered = bool((outcomes["full"].text or "").strip())
            for name, m, eng in runners:
                rec = retrieval_record(ctx.run_id, req, ask, m, outcomes[name], outcomes["full"], name=name)
                rec["many_hits"] = rec["chunk_hits"] >= min_hits
                if name != "full" and logps.get(name) and logps.get("full"):
                    rec["answer_drift_full"] = answer_drift(logps[name], logps["full"])
                elif name in exact and answered:
                    rec["answer_drift_full"], rec["drift_unscored"] = 0.0, True
                if name in orders or name in ref_orders:
                    perm = orders[name] if name in orders else ref_orders[name]
                    rec["prompt_order"] = [req.order[i] for i in perm]
                if name in own:
                    ref, perm = own[name], orders[name]
                    rec["drift_reference"] = ref
                    # else its reference's answer came from a full prefill in its order, run for it
                    rec["reference_in_own_order"] = same = perm == ref_orders[ref]
                    ref_logps = own_logps.get(ref) if same else others.get(perm, ("", None))[1]
                    if own_logps.get(name) and ref_logps:
                        rec["answer_drift_own_order"] = answer_drift(own_logps[name], ref_logps)
                    elif name in own_exact and (outcomes[ref].text or "").strip():
                        rec["answer_drift_own_order"] = 0.0
                if name in owned:
                    rec.update(store_usage(eng.store.stats()))
                out.append(rec)
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(_postfix(out))
        # the knowledge tree's refreshes: engine time spent off the clock, in the idle time the bench gives
        ctx.extras[workload]["refresh"] = {name: dict(e.writeback.refresh_counts) for name, e in owned.items()}
    ctx.records.extend(out)
    return out


def _warm_stores(engines: MethodEngines, owned: dict, texts: list[str], how: dict, store: dict, *, progress: bool):
    """Warm the pool into every method's store: computed once per kind of chunk KV, then copied.

    The methods' engines differ in how they *use* chunk KV, not in how a warm computes it, except
    through ``chunk_context``, ``warm_window_tokens`` and ``warm_variants``: engines alike in them
    get the records of one warm (on a scratch engine with the run's store settings, so no method's
    store is read or promoted by the copying), each record put as the warm itself puts it (the
    chunk's variants, each with its context), and the order the warm computed them in told to the
    method's chunk-access table (as the warm tells its own: frequency order's ties follow it).
    """
    groups: dict[tuple[str, int, int], list[str]] = {}
    for name, eng in owned.items():
        cfg = eng.config
        variants = cfg.warm_variants_for(how.get("order", "given"))
        groups.setdefault((cfg.chunk_context, cfg.warm_window_tokens, variants), []).append(name)
    out = {}
    for (context, window, variants), names in groups.items():
        src = engines.scratch(**store, chunk_context=context, warm_window_tokens=window, warm_variants=variants)
        res = src.warm(texts, progress=progress, **how)
        src.flush()
        for name in names:
            t0 = time.perf_counter()
            copied = _copy_records(src, owned[name], texts)
            owned[name].flush()
            by_key = {chunk_key(t): t for t in texts}
            streamed = src.access.computation_order(src.config.namespace)
            owned[name].access.computed(owned[name].config.namespace, [by_key[k] for k in streamed if k in by_key])
            out[name] = {
                "computed": res.computed,
                "variants": res.variants,
                "tokens": res.tokens,
                "seconds": res.seconds,
                "copied": copied,
                "copy_seconds": time.perf_counter() - t0,
                "shared_with": [n for n in names if n != name],
            }
        engines.discard(src)
    return out


def _copy_records(src, dst, texts: list[str]) -> int:
    """Put each text's stored chunk KV from ``src`` into ``dst`` as the warm put it: every chunk's
    first variant, then the second ones, kept ahead of need (speculative); returns how many records."""
    firsts, seconds = [], []
    for text in dict.fromkeys(texts):
        ids = src.prompt_tokenizer.tokenize(text)
        key = src.planner.chunk_key(ids)
        for slot in src.variants.index.keys(key) or [key]:
            (firsts if slot == key else seconds).append((key, slot, ids))
    copied = 0
    for speculative, batch in ((False, firsts), (True, seconds)):
        for key, slot, ids in batch:
            rec = src.store.get(slot, ids)
            if rec is None:
                continue
            twin = KVRecord(
                token_ids=rec.token_ids.clone(),
                k=rec.k.clone(),
                v=rec.v.clone(),
                kind=rec.kind,
                context=rec.context,
                meta=dict(rec.meta),
                stats={n: t.clone() for n, t in rec.stats.items()},
            )
            context, exact = tuple(rec.meta.get("context", ())), rec.meta.get("exact")
            copied += dst.variants.keep(key, twin, context, exact, speculative=speculative)
    return copied


def _same_order_refs(methods: list[Method]) -> dict[str, str]:
    """Method name -> the full prefill's in the same chunk order, for the methods with an order of
    their own (``auto+order=frequency`` -> ``full+order=frequency``) whose reference is being run."""
    fulls = {m.order: m.name for m in methods if getattr(m, "mode", None) == "full" and m.name != "full"}
    return {
        m.name: fulls[m.order]
        for m in methods
        if getattr(m, "order", None) is not None and getattr(m, "mode", None) != "full" and m.order in fulls
    }


def _prompt_order(engine, method: Method, req: Request) -> tuple[int, ...]:
    """The chunk order ``method`` will put ``req``'s chunks in on ``engine`` (indices into
    ``req.chunks``): what its chunk-access table says now, before the request is counted."""
    if req.prompt is not None or len(req.chunks) < 2:
        return tuple(range(len(req.chunks)))
    return tuple(engine.access.order(engine.config.namespace, req.chunks, method.order))


def _permuted(req: Request, perm: tuple[int, ...]) -> Request:
    """``req`` with its chunks (and passage ids) in the order ``perm``."""
    return replace(req, chunks=[req.chunks[i] for i in perm], order=[req.order[i] for i in perm])


def _as_given(method: Method) -> Method:
    """``method`` putting chunks in the order given (a reference told its order explicitly)."""
    plain = copy.copy(method)
    plain.order = None
    return plain


def _reference(runners, name: str, req: Request, max_new: int) -> tuple[str, list[float] | None]:
    """Reference ``name``'s answer to ``req`` as given, and its log-probabilities (untimed, unrecorded)."""
    m, eng = next((_as_given(m), e) for n, m, e in runners if n == name)
    text = m.run(eng, req, max_new_tokens=max_new).text
    return text, (m.score_tokens(eng, req, text) if text and text.strip() else None)


def _blends_nothing(engine, req: Request) -> bool:
    """True when the store holds none of the request's chunks (key lookups only, nothing loaded).

    Its prefill then reuses no chunk KV (every token computed, or an exact prefix), the same
    computation as the full prefill's, so its drift is 0 and a scoring prefill (~a full one) would
    only confirm it. In write-back mode that is every first ask of a question with new passages.
    """
    if req.prompt is not None:
        return engine.lookup(prompt=req.prompt).chunks_stored == 0
    return engine.lookup(req.chunks, req.prefix, req.suffix).chunks_stored == 0


def retrieval_record(
    run_id: str, req: Request, ask: Ask, method: Method, out: Outcome, ref: Outcome, *, name: str
) -> dict:
    """:func:`~benchmarks.workloads.make_record`'s row plus the ask and what the store held."""
    rec = make_record(run_id, req, method, out, ref, name=name)
    rec.update(
        question_index=ask.question,
        occurrence=ask.occurrence,
        wording=ask.wording,
        passages=list(req.order),
        exact_tokens=out.extra.get("exact_tokens", 0),
    )
    if method.uses_store and out.prompt_tokens:
        rec["uncached_share"] = 1.0 - out.cached_tokens / out.prompt_tokens
        if rec.get("ttft_ratio_full") is not None:
            rec["ttft_excess_full"] = rec["ttft_ratio_full"] - rec["uncached_share"]
    return rec


def _facts(ctx: RunContext, corpus: Corpus, stream, mode: str, min_hits: int, owned: dict, warmed: dict) -> dict:
    per_token = kv_bytes_per_token(ctx.engine)
    pool_tokens = sum(ctx.engine.count_tokens(t) for t in corpus.passages)
    asked = {i for _, top in stream for i in top}
    budgets = {name: eng.config.memory_budget_bytes for name, eng in owned.items()}
    return {
        "store_mode": mode,
        "requests": len(stream),
        "questions": len({a.question for a, _ in stream}),
        "returns": sum(a.occurrence > 0 for a, _ in stream),
        "top_k": len(stream[0][1]) if stream else 0,
        "min_hits": min_hits,
        "embedder": ctx.opt("embedder", "minilm"),
        "zipf_s": ctx.opt("zipf", 1.0),
        "corpus_order": ctx.opt("corpus_order", "shuffled") if mode == "corpus" else None,
        "pool_passages": len(corpus.passages),
        "pool_tokens": pool_tokens,
        "pool_kv_bytes": pool_tokens * per_token,
        "retrieved_passages": len(asked),
        "memory_budget_bytes": budgets,
        "disk_tier": bool(ctx.engine.config.disk_tier),
        "warmed": warmed,
    }


def _postfix(records: list[dict]) -> str:
    """Running figures per method: paired TTFT × full (median), drift (mean), hit rate."""
    parts = []
    for name in dict.fromkeys(r["method"] for r in records if r["method"] != "full"):
        mine = [r for r in records if r["method"] == name]
        ratio = summarize(r.get("ttft_ratio_full") for r in mine)["median"]
        drift = summarize(r.get("answer_drift_full") for r in mine)["mean"]
        hits = sum(r["chunk_hits"] for r in mine) / max(1, sum(r["chunks"] for r in mine))
        part = f"{name} {ratio:.2f}x" if ratio is not None else name
        parts.append(part + (f" d{drift:.3f}" if drift is not None else "") + f" h{hits:.0%}")
    return " | ".join(parts)
