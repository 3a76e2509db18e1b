"""One benchmark run: options in, results.json + results.md + plots out."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.conversations import run_conversations
from benchmarks.corpus import CORPUS_ORDERS, EMBEDDERS
from benchmarks.data import (
    DEFAULT_ANSWER_HINT,
    DEFAULT_INSTRUCTIONS,
    DEFAULT_SYSTEM,
    PromptFormat,
    QAItem,
    load_dataset,
)
from benchmarks.methods import parse_methods
from benchmarks.report import aggregate, run_metadata, write_results
from benchmarks.retrieval import STORE_MODES, run_retrieval
from benchmarks.workloads import RunContext, run_questions, run_stream
from kvrag.engine.store.policy import check_policy
from kvrag.errors import InvalidRequestError

__all__ = ["BenchOptions", "run_bench", "DEFAULT_METHODS", "WORKLOADS", "ALIASES"]

DEFAULT_METHODS = "hf,full,prefix,reuse,blend,blend@1.0"

#: Workload name -> runner(ctx, items); a new workload registers its runner here (the runners
#: import the shared pieces from :mod:`benchmarks.workloads`, never this module).
WORKLOADS: dict[str, Callable[[RunContext, list[QAItem]], list[dict]]] = {
    "questions": run_questions,
    "stream": run_stream,
    "conversations": run_conversations,
    "retrieval": run_retrieval,
}
#: Aliases a/b/c/r follow the issues' lettering.
ALIASES = {"a": "questions", "b": "stream", "c": "conversations", "r": "retrieval"}


@dataclass
class BenchOptions:
    """Settings of a run (the command line's flags).

    Attributes:
        dataset: QA file (``[{"question", "answers", "ctxs": [{"title", "text"}]}]``).
        n: questions (the first n after ``skip``); skip: questions skipped first (held-out runs).
        top_k: passages per request (the first k of each question's ``ctxs``).
        methods: comma-separated method names (``full`` is always added).
        order: ``shuffled`` (seeded) or ``given`` passage order.
        warm_company: workload (a)'s pre-warming: ``request`` (a question's passages together, in
            dataset order) or ``other`` (each passage behind ``warm_others`` passages of other
            questions: KV first computed for other requests, as in a shared store; the engine's
            store is emptied before each request).
        seed: seed of passage orders and of the stream.
        repeat: requests per question in workload (a), each with a fresh order when shuffled.
        max_new_tokens: answer length limit in workload (a).
        score: methods whose gold-answer log-likelihood is measured: ``auto`` (all but blend@1.0),
            ``all``, ``none`` or names.
        workloads: comma-separated: ``a``/``questions``, ``b``/``stream``, ``c``/``conversations``,
            ``r``/``retrieval``.
        stream_*: workload (b): requests, methods, answer length, budget (bytes, or a fraction of
            the pool's KV bytes), Zipf exponent.
        eviction_policy: the stream store's policy (any name the engine accepts).
        conv_*: workload (c): turns per conversation, passages per turn, methods, answer length.
        retrieval_*: workload (r): methods, stream length (``None``: twice ``n``), answer length,
            scored methods (as ``score``), the fewest chunk hits of the "many hits" figures
            (``None``: two thirds of ``top_k``), the memory budget of each method's store (``None``:
            the engine's). ``zipf`` is then the popularity of questions, ``top_k`` the passages retrieved.
        store: workload (r)'s store modes, ``corpus`` and/or ``writeback``.
        corpus_order: how ``--store corpus`` warms the pool: ``similar`` (kvrag's own way), ``shuffled`` or ``dataset``.
        embedder: workload (r)'s retrieval embeddings: ``minilm`` (bundled) or ``lexical`` (hashed words).
        model: model for the engine (None: the bundled model); ``config``: EngineConfig overrides.
        out: output directory.
    """

    dataset: str
    n: int = 20
    skip: int = 0
    top_k: int = 6
    methods: str = DEFAULT_METHODS
    order: str = "shuffled"
    warm_company: str = "request"
    warm_others: int = 3
    seed: int = 0
    repeat: int = 1
    max_new_tokens: int = 32
    score: str = "auto"
    workloads: str = "a,b"
    stream_requests: int = 24
    stream_methods: str = "full,blend"
    stream_max_new_tokens: int = 8
    stream_questions: int | None = None
    stream_budget_bytes: int | None = None
    stream_disk_budget_bytes: int | None = None
    stream_budget_frac: float = 0.25
    zipf: float = 1.0
    eviction_policy: str = "lru"
    conv_turns: int = 3
    conv_top_k: int = 2
    conv_methods: str = "full,blend,conv"
    conv_max_new_tokens: int = 24
    retrieval_methods: str = "full,auto,probe@0.15,hkvd@0.15,epic@0.15"
    retrieval_requests: int | None = None
    retrieval_max_new_tokens: int = 32
    retrieval_score: str = "auto"
    retrieval_min_hits: int | None = None
    retrieval_budget_bytes: int | None = None
    store: str = "corpus,writeback"
    corpus_order: str = "similar"
    embedder: str = "minilm"
    windows: int = 5
    model: str | None = None
    config: dict = field(default_factory=dict)
    system: str = DEFAULT_SYSTEM
    instructions: str = DEFAULT_INSTRUCTIONS
    answer_hint: str = DEFAULT_ANSWER_HINT
    out: str = "bench-out"
    plots: bool = True
    progress: bool = True

    def check(self) -> None:
        if self.skip < 0:
            raise InvalidRequestError("--skip must be >= 0")
        if self.n < 1 or self.top_k < 1 or self.repeat < 1 or self.stream_requests < 1:
            raise InvalidRequestError("--n, --top-k, --repeat and --stream-requests must be >= 1")
        if self.order not in ("shuffled", "given"):
            raise InvalidRequestError(f"--order must be 'shuffled' or 'given', got {self.order!r}")
        if self.warm_company not in ("request", "other"):
            raise InvalidRequestError(f"--warm-company must be 'request' or 'other', got {self.warm_company!r}")
        if self.warm_others < 1:
            raise InvalidRequestError("--warm-others must be >= 1")
        if not 0 < self.stream_budget_frac <= 10:
            raise InvalidRequestError("--stream-budget-frac must be in (0, 10]")
        if self.max_new_tokens < 1 or self.stream_max_new_tokens < 1 or self.retrieval_max_new_tokens < 1:
            raise InvalidRequestError("answer lengths must be >= 1 token")
        if self.retrieval_requests is not None and self.retrieval_requests < 1:
            raise InvalidRequestError("--retrieval-requests must be >= 1")
        if self.retrieval_min_hits is not None and not 1 <= self.retrieval_min_hits <= self.top_k:
            raise InvalidRequestError(f"--retrieval-min-hits must be in [1, --top-k={self.top_k}]")
        bad = set(self.store_modes()) - set(STORE_MODES)
        if bad or not self.store_modes():
            raise InvalidRequestError(f"--store takes {' and/or '.join(STORE_MODES)}, got {self.store!r}")
        if self.corpus_order not in CORPUS_ORDERS:
            raise InvalidRequestError(f"--corpus-order must be one of {CORPUS_ORDERS}, got {self.corpus_order!r}")
        if self.embedder not in EMBEDDERS:
            raise InvalidRequestError(f"--embedder must be one of {EMBEDDERS}, got {self.embedder!r}")

    def store_modes(self) -> list[str]:
        return [m.strip() for m in self.store.split(",") if m.strip()]

    def workload_names(self) -> list[str]:
        names = []
        for w in (x.strip() for x in self.workloads.split(",") if x.strip()):
            name = ALIASES.get(w, w)
            if name not in WORKLOADS:
                raise InvalidRequestError(
                    f"unknown workload {w!r}; use a/questions, b/stream, c/conversations, r/retrieval"
                )
            names.append(name)
        return names


def _scored(spec: str, methods, flag: str) -> list[str]:
    """The methods whose answer drift (and gold log-likelihood) a workload measures.

    ``auto``: every answering method but blend at ratio 1.0, whose prefill is the full one by
    construction (its identity to full is measured on the answers instead): saves a full prefill.
    """
    auto = [m.name for m in methods if m.answers and getattr(m, "ratio", None) != 1.0]
    score = {"all": [m.name for m in methods], "none": [], "auto": auto}.get(spec.strip())
    if score is None:
        score = [s.strip() for s in spec.split(",") if s.strip()]
        unknown = set(score) - {m.name for m in methods}
        if unknown:
            raise InvalidRequestError(f"{flag} names methods not being run: {', '.join(sorted(unknown))}")
    return score


def _progress_factory(enabled: bool) -> Callable | None:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return lambda it, desc, total: tqdm(it, desc=desc, total=total, dynamic_ncols=True, leave=True)


def run_bench(
    opts: BenchOptions,
    *,
    engine=None,
    engine_factory: Callable[[], object] | None = None,
    argv: list[str] | None = None,
) -> dict:
    """Run the benchmark and write its outputs into ``opts.out``.

    Args:
        opts: the run's settings.
        engine: an engine to measure (not closed here), e.g. one built over a test model.
        engine_factory: called once to build the engine (closed at the end) when ``engine`` is None;
            by default ``Engine.from_pretrained(opts.model, **opts.config)``.
        argv: the command line, for the record.

    Returns:
        ``{"meta", "summary", "records", "extras", "paths"}``.
    """
    opts.check()
    names = opts.workload_names()
    methods = parse_methods(opts.methods)
    stream_methods = parse_methods(opts.stream_methods) if "stream" in names else None
    conv_methods = parse_methods(opts.conv_methods) if "conversations" in names else None
    retrieval_methods = parse_methods(opts.retrieval_methods) if "retrieval" in names else None
    score = _scored(opts.score, methods, "--score")
    retrieval_score = _scored(opts.retrieval_score, retrieval_methods, "--retrieval-score") if retrieval_methods else []
    items = load_dataset(opts.dataset, opts.skip + opts.n)[opts.skip :]
    stream_items = items
    if opts.stream_questions:
        stream_items = load_dataset(opts.dataset, opts.stream_questions)
    owned = engine is None
    t_start, cpu_start = time.perf_counter(), time.process_time()
    load = None  # a method in another dtype (full+dtype=float32): the model loaded in it, when we load it
    if engine is None:
        if engine_factory is None:
            from kvrag import Engine

            model, overrides = opts.model, dict(opts.config)
            engine_factory = lambda: Engine.from_pretrained(model, **overrides)  # noqa: E731
            load = lambda config, store: Engine.from_pretrained(config=config, store=store)  # noqa: E731
        engine = engine_factory()
    out_dir = Path(opts.out)
    ctx = None
    try:
        run_id = uuid.uuid4().hex
        settings = {k: v for k, v in dataclasses.asdict(opts).items() if k not in ("progress", "plots")}
        settings["dataset"] = os.path.abspath(opts.dataset)
        if "stream" in names:  # a bad store setting fails now, not after workload (a)
            for policy in str(opts.eviction_policy).split(","):
                config = engine.config.replace(eviction_policy=policy.strip(), **(opts.config or {}))
                check_policy(config.eviction_policy)
        meta = run_metadata(engine, run_id, list(argv or []), settings)
        fmt = PromptFormat(engine.tokenizer, opts.system, opts.instructions, opts.answer_hint)
        meta["prompt_style"] = fmt.style
        options = dict(
            top_k=opts.top_k,
            repeat=opts.repeat,
            order=opts.order,
            seed=opts.seed,
            warm_company=opts.warm_company,
            warm_others=opts.warm_others,
            max_new_tokens=opts.max_new_tokens,
            score_methods=score,
            stream_requests=opts.stream_requests,
            stream_methods=stream_methods,
            stream_max_new_tokens=opts.stream_max_new_tokens,
            zipf=opts.zipf,
            stream_budget_bytes=opts.stream_budget_bytes,
            stream_budget_frac=opts.stream_budget_frac,
            stream_disk_budget_bytes=opts.stream_disk_budget_bytes,
            eviction_policy=opts.eviction_policy,
            conv_turns=opts.conv_turns,
            conv_top_k=opts.conv_top_k,
            conv_methods=conv_methods,
            conv_max_new_tokens=opts.conv_max_new_tokens,
            retrieval_methods=retrieval_methods,
            retrieval_requests=opts.retrieval_requests,
            retrieval_max_new_tokens=opts.retrieval_max_new_tokens,
            retrieval_score_methods=retrieval_score,
            retrieval_min_hits=opts.retrieval_min_hits,
            retrieval_budget_bytes=opts.retrieval_budget_bytes,
            stores=opts.store_modes(),
            corpus_order=opts.corpus_order,
            embedder=opts.embedder,
        )
        ctx = RunContext(engine, methods, fmt, run_id, options, progress=_progress_factory(opts.progress), load=load)
        paths: dict = {}

        def checkpoint() -> None:  # after each workload (and each part of a long one)
            nonlocal paths, summary
            meta["wall_s"] = time.perf_counter() - t_start
            meta["cpu_s"] = time.process_time() - cpu_start  # cpu_s / wall_s far below the threads: contention
            meta["load_avg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
            summary = aggregate(ctx.records, opts.windows)
            paths = write_results(out_dir, meta, ctx.records, summary, ctx.extras)

        summary: dict = {}
        ctx.checkpoint = checkpoint
        for name in names:
            WORKLOADS[name](ctx, stream_items if name == "stream" else items)
            if owned:
                engine.store.clear()  # the next workload starts cold
            checkpoint()
        if opts.plots:
            from benchmarks.plots import write_plots

            paths["plots"] = write_plots(out_dir, ctx.records, summary)
        meta["wall_s"] = time.perf_counter() - t_start
        meta["cpu_s"] = time.process_time() - cpu_start
        paths.update(write_results(out_dir, meta, ctx.records, summary, ctx.extras))
        return {"meta": meta, "summary": summary, "records": ctx.records, "extras": ctx.extras, "paths": paths}
    finally:
        if ctx is not None:
            ctx.close()
        if owned:
            engine.close()
