"""RAGCache's dynamic speculative pipelining: TTFT from the query's arrival, search included.

    python -m benchmarks speculation [--dataset musique_dev.json] [--n 40] [--n-distractors 1000000]
                        [--nlist 1024] [--nprobe 1024] [--stages 4] [--loads 0.1,1.5] [--top-k 6]
                        [--near-distractors 0] [--near-cos 0.8] [--dry-run]
                        [--arms none,dynamic,always,chunks,oracle] [--embedder minilm] [--config F=V ...]

The corpus is the dev questions' passages plus ``--n-distractors`` synthetic unit vectors (random
directions: they are never near a question, they only make the search slow), in one IVF index
(inner product) scanned at ``--nprobe`` lists in ``--stages`` stages
(:mod:`kvrag.integrations.staged_search`). Random distractors never come near a question, so the
top-k is all passages and is mostly settled after the first stage (a speculation hardly ever
loses); ``--near-distractors M`` adds M hard ones: noisy copies of the passages' vectors (cosine
``--near-cos`` with the passage copied), each standing for *another* passage's text, so that the
top-k changes between stages as a real corpus's does (a prompt then holds the texts of the final
ids, each once). Before the model is loaded the bench prints how often the top-k changes after the
first stage (:func:`stage_changes`): how often a speculation can lose; ``--dry-run`` stops there
(no model). Requests arrive as a Poisson process at each
``--loads`` multiple of the engine's service rate (measured first: 1 / a cold request's TTFT);
each request embeds its question, searches, and streams the top-k passages' prompt. Every arm
replays the same arrivals and questions on an emptied cache (paired):

- ``none``: the search, then the request.
- ``dynamic``: after each stage whose top-k changed, a prompt-level speculation of that list
  (:meth:`~kvrag.Engine.speculate_request`: idle engine time only, stopped when a request
  arrives); the final request adopts it if its list is the last one speculated.
- ``always``: the same speculations queued as ordinary work (never give way): RAGCache's static
  pipelining, the baseline that should lose under load.
- ``chunks``: chunk-level speculation only (:meth:`~kvrag.Engine.speculate`).
- ``oracle``: the search takes no time (its result known at arrival): the ceiling.

Reported per load and arm: p50/p90 TTFT from arrival, mean search time, mean non-overlapped
search time (search time not overlapped by a prefill of the final list: RAGCache's Table 3),
wasted speculative tokens (computed by speculations that were not adopted), restarts
(speculations started and not adopted) and the adoption rate; then totals that queueing noise does
not move: prefill tokens computed (the requests' own plus what speculations not adopted computed:
lost prompts, stopped passes, kept chunks), the engine's busy time and the makespan (first arrival
to last answer), and each arm's per-request TTFT differences from ``none`` (median and quartiles;
same arrivals, same questions). The honest ceiling of any speculation is (search + TTFT) / TTFT of
the ``none`` arm; a lost speculation costs at most the search time after it started, so
always-speculate's cost under load is at most (share of the search after which the list still
changes) x search time per request.

Threads (2 cores): torch gets ``--config num_threads=1`` by default and faiss one OpenMP thread,
so a search and a prefill each hold one core (docs/journal/threads.md, "Threads on a small machine").
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.corpus import EMBEDDERS, make_embedder
from benchmarks.data import PromptFormat, load_dataset
from benchmarks.metrics import percentile

__all__ = ["ARMS", "build_index", "near_copies", "near_texts", "texts_of", "stage_changes", "run_arm", "paired", "main"]

ARMS = ("none", "dynamic", "always", "chunks", "oracle")


def build_index(
    passages: np.ndarray, n_distractors: int, nlist: int, seed: int, near_distractors: int = 0, near_cos: float = 0.8
):
    """An IVF inner-product index of the passages (ids 0..P-1), then ``near_distractors`` noisy copies
    of them (:func:`near_copies`, ids P..P+M-1), then random unit distractors."""
    import faiss

    d = passages.shape[1]
    rng = np.random.default_rng(seed)
    near = near_copies(passages, near_distractors, near_cos, rng)
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
    train = [passages, near]
    sample = min(n_distractors, max(40 * nlist, 10_000))
    if sample:
        train.append(_unit(rng.standard_normal((sample, d), dtype=np.float32)))
    index.train(np.concatenate(train))
    index.add(passages)
    if len(near):
        index.add(near)
    for start in range(0, n_distractors, 100_000):  # in blocks: a 1M x 384 float block is 1.5 GB at once
        block = min(100_000, n_distractors - start)
        index.add(_unit(rng.standard_normal((block, d), dtype=np.float32)))
    return index


def near_copies(passages: np.ndarray, n: int, cos: float, rng) -> np.ndarray:
    """``n`` hard distractors: copy ``j`` is passage ``j % P`` turned by a random direction to cosine
    ``cos`` with it (``cos * v + sqrt(1 - cos^2) * u``, ``u`` a random unit vector orthogonal to ``v``)."""
    d = passages.shape[1]
    if n <= 0:
        return np.zeros((0, d), dtype=np.float32)
    if not 0.0 < cos < 1.0:
        raise ValueError(f"near_cos must be in (0, 1), got {cos}")
    v = passages[np.arange(n) % len(passages)]
    u = rng.standard_normal((n, d), dtype=np.float32)
    u -= np.sum(u * v, axis=1, keepdims=True) * v  # orthogonal to v (v is a unit vector)
    u = _unit(u)
    return _unit(cos * v + np.sqrt(1.0 - cos * cos) * u)


def near_texts(n_passages: int, n: int) -> np.ndarray:
    """The passage whose text hard distractor ``j`` stands for: never the one it copies (``j % P``),
    so that a copy entering the top-k changes the prompt as another document would."""
    j = np.arange(n)
    if n_passages < 2:
        return j % max(1, n_passages)
    return (j % n_passages + 1 + (j // n_passages) % (n_passages - 1)) % n_passages


def texts_of(ids, passages: list[str], near: np.ndarray) -> list[str]:
    """The prompt's chunks of a row of ids, in rank order: a passage's text, a hard distractor's
    stand-in text (:func:`near_texts`), random distractors and missing results left out, each text once."""
    out: list[str] = []
    p = len(passages)
    for i in (int(i) for i in ids):
        if 0 <= i < p:
            text = passages[i]
        elif p <= i < p + len(near):
            text = passages[int(near[i - p])]
        else:
            continue
        if text not in out:
            out.append(text)
    return out


def stage_changes(index, queries: np.ndarray, k: int, stages: int, nprobe: int) -> dict:
    """How often a staged search's top-k changes after its first stage: how often a speculation can lose.

    Model-free (the index and the query vectors only). Per query: ``changed_after_first``, the
    stages after the first whose top-k differs from the stage before (each one stops a running
    speculation and may start another: a restart); ``first_is_final``, the first stage's top-k is
    already the search's result (a speculation started at the first stage wins); ``final_changed``,
    the last stage itself changed the list (whatever was speculated last loses outright); and
    ``settled_at``, the 1-based stage from which the top-k stays the final one (the share of the
    search a winning speculation can overlap is ``1 - settled_at / stages``). Summed up:
    ``mean_lost_fraction``, the mean share of the search from the end of the first stage to the
    end of the stage where the list settles (``(settled_at - 1) / stages``): the time in which a
    speculation kept running from the first stage on computes lists that lose, i.e. the most a
    static speculation can waste per request, as a share of the search time.
    """
    from kvrag.integrations.staged_search import staged_search

    rows = []
    for q in queries:
        history = [stage.ids[0].copy() for stage in staged_search(index, q[None, :], k, stages=stages, nprobe=nprobe)]
        final = history[-1]
        changed = [not np.array_equal(a, b) for a, b in zip(history, history[1:])]
        settled = len(history)
        while settled > 1 and np.array_equal(history[settled - 2], final):
            settled -= 1
        rows.append(
            {
                "stages": len(history),
                "changed_after_first": sum(changed),
                "first_is_final": bool(np.array_equal(history[0], final)),
                "final_changed": bool(changed and changed[-1]),
                "settled_at": settled,
            }
        )
    n = len(rows)
    return {
        "queries": n,
        "stages": rows[0]["stages"] if rows else 0,
        "share_changed_after_first": sum(r["changed_after_first"] > 0 for r in rows) / n if n else 0.0,
        "mean_changed_stages": float(np.mean([r["changed_after_first"] for r in rows])) if n else 0.0,
        "share_final_changed": sum(r["final_changed"] for r in rows) / n if n else 0.0,
        "mean_settled_fraction": float(np.mean([r["settled_at"] / r["stages"] for r in rows])) if n else 0.0,
        "mean_lost_fraction": float(np.mean([(r["settled_at"] - 1) / r["stages"] for r in rows])) if n else 0.0,
        "rows": rows,
    }


def print_stage_changes(stats: dict, nprobe: int, nlist: int) -> None:
    """What a reader sees before the model's time is spent: how often a speculation can lose."""
    print(
        f"stage changes ({stats['queries']} queries, {stats['stages']} stages over nprobe={nprobe} of {nlist} "
        f"lists): the top-k changes after stage 1 for {stats['share_changed_after_first']:.0%} of queries, "
        f"{stats['mean_changed_stages']:.2f} changed stages per query, at the last stage for "
        f"{stats['share_final_changed']:.0%}; lists still losing for {stats['mean_lost_fraction']:.1%} of the "
        "search (mean)"
    )


def _unit(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)


class _Request(threading.Thread):
    """One request's life from its arrival: embed, staged search (speculating per the arm), stream."""

    def __init__(self, bench: dict, rid: int, item, arrival: float, arm: str) -> None:
        super().__init__(daemon=True)
        self.bench, self.rid, self.item, self.arrival, self.arm = bench, rid, item, arrival, arm
        self.row: dict = {}
        self.handles: list = []

    def run(self) -> None:
        from kvrag.integrations.staged_search import staged_search

        b, arm = self.bench, self.arm
        engine, fmt, passages = b["engine"], b["format"], b["passages"]
        wait = self.arrival - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        t0 = time.perf_counter()
        suffix = f"{fmt.question_head}{self.item.question}{fmt.tail}"
        spec, speculated, stages, handles = None, None, 0, []

        def chunks_of(ids) -> list[str]:
            return texts_of(ids, passages, b["near"])

        if arm == "oracle":
            final = b["oracle"][self.rid]
            search_end = t0
        else:
            q = b["embed"]([self.item.question])
            for stage in staged_search(b["index"], q, b["top_k"], stages=b["stages"], nprobe=b["nprobe"]):
                stages += 1
                if stage.final:
                    final = chunks_of(stage.ids[0])
                    break
                if not stage.changed or arm == "none":
                    continue
                speculated = chunks_of(stage.ids[0])
                if arm == "chunks":
                    handles.append(engine.speculate(speculated, key=self.rid))
                else:
                    spec = engine.speculate_request(
                        speculated, fmt.head, suffix, key=self.rid, dynamic=arm == "dynamic", **b["request"]
                    )
                    handles.append(spec)
            search_end = time.perf_counter()
            if spec is not None and speculated != final:
                spec.cancel()  # Algorithm 2: the final list differs from the speculated one
        stream = engine.stream(final, fmt.head, suffix, **b["request"])
        first = None
        for _ in stream:
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        adopted = spec is not None and spec.state == "adopted"
        search_s = search_end - t0
        overlapped_from = spec.started_at if adopted and spec.started_at is not None else search_end
        self.row = {
            "request": self.rid,
            "ttft_s": (first or time.perf_counter()) - t0,
            "search_s": search_s,
            "non_overlapped_s": min(search_s, max(0.0, overlapped_from - t0)),
            "adopted": adopted,
            "stages": stages,
            "engine_ttft_s": stream.generation.ttft_s if stream.generation else None,
            "end_s": end - self.arrival,
            "computed_tokens": stream.generation.stats.computed_tokens if stream.generation else 0,
        }
        self.handles = handles


def run_arm(bench: dict, arm: str, items: list, arrivals: list[float]) -> dict:
    """Replay the arrivals on an emptied cache; the arm's rows and totals."""
    engine = bench["engine"]
    engine.flush()
    engine.store.clear()
    engine.variants.index.clear()
    before = dict(engine.speculations.counts)
    busy_before = engine.queue_stats()["busy_s"]
    start = time.perf_counter() + 0.5
    threads = [_Request(bench, i, item, start + at, arm) for i, (item, at) in enumerate(zip(items, arrivals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _wait_idle(engine)
    counts = {k: engine.speculations.counts[k] - before[k] for k in before}
    rows = [t.row for t in threads]
    ttft = [r["ttft_s"] for r in rows]
    # every token the engine prefilled: the requests' own (an adopted one's is its speculation's)
    # and what speculations not adopted computed (lost prompts, stopped passes, kept chunks)
    spec_tokens = sum(h.computed for t in threads for h in t.handles if h.state != "adopted")
    return {
        "arm": arm,
        "rows": rows,
        "p50_ttft_s": percentile(ttft, 50),
        "p90_ttft_s": percentile(ttft, 90),
        "mean_search_s": float(np.mean([r["search_s"] for r in rows])),
        "mean_non_overlapped_s": float(np.mean([r["non_overlapped_s"] for r in rows])),
        "adoption_rate": sum(r["adopted"] for r in rows) / len(rows),
        "wasted_tokens": counts["wasted_tokens"],
        "restarts": counts["started"] - counts["adopted"] if arm in ("dynamic", "always") else counts["stopped"],
        "speculation_counts": counts,
        "prefill_tokens": sum(r["computed_tokens"] for r in rows) + spec_tokens,
        "speculation_tokens": spec_tokens,
        "busy_s": engine.queue_stats()["busy_s"] - busy_before,
        "makespan_s": max(t.arrival + t.row["end_s"] for t in threads) - min(t.arrival for t in threads),
    }


def paired(runs: list[dict], base: str = "none") -> None:
    """Add to each run its per-request TTFT differences from the ``base`` arm's run of the same
    requests (same arrivals, same questions): ``paired_median_s`` and the quartiles
    ``paired_p25_s`` / ``paired_p75_s`` (negative: faster than ``base``). Under load the
    differences of neighbouring requests are correlated (one queue): read them beside the totals."""
    ref = next((r for r in runs if r["arm"] == base), None)
    if ref is None:
        return
    by_request = {row["request"]: row["ttft_s"] for row in ref["rows"]}
    for r in runs:
        diffs = [row["ttft_s"] - by_request[row["request"]] for row in r["rows"] if row["request"] in by_request]
        if diffs:
            r["paired_median_s"] = percentile(diffs, 50)
            r["paired_p25_s"] = percentile(diffs, 25)
            r["paired_p75_s"] = percentile(diffs, 75)


def _wait_idle(engine, timeout: float = 120.0) -> None:
    """Until the engine thread has nothing running or waiting (the arm's last speculations ended)."""
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        stats = engine.queue_stats()
        if not stats["running"] and not stats["waiting"]:
            return
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    import faiss

    from benchmarks.specs import command_line_overrides
    from kvrag import Engine

    p = argparse.ArgumentParser(prog="python -m benchmarks speculation", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dataset", default="../shared/data/musique_dev.json")
    p.add_argument("--n", type=int, default=40, help="questions (requests per arm and load)")
    p.add_argument("--n-distractors", type=int, default=1_000_000)
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=None, help="lists scanned (default all: --nlist)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument(
        "--near-distractors",
        type=int,
        default=0,
        help="hard distractors: noisy copies of the passages' vectors (cosine --near-cos with the one "
        "copied), each standing for another passage's text, so that the top-k changes between stages "
        "as in a real corpus (default 0: random distractors only)",
    )
    p.add_argument("--near-cos", type=float, default=0.8, help="cosine of a hard distractor with its passage")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="no model: build the index, print how often the top-k changes after the first stage, stop",
    )
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--loads", default="0.1,1.5", help="arrival rates as multiples of the service rate")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--embedder", default="minilm", choices=EMBEDDERS)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--out", default=None, help="write every row as JSON here")
    a = p.parse_args(argv)
    arms = a.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}; use {', '.join(ARMS)}")
    if a.near_distractors < 0 or not 0.0 < a.near_cos < 1.0:
        p.error("--near-distractors must be >= 0 and --near-cos in (0, 1)")
    faiss.omp_set_num_threads(1)
    overrides = {"num_threads": 1, **command_line_overrides(a.config)}
    items = load_dataset(a.dataset, a.n)
    passages = sorted({t for item in items for t in item.passages})
    embed = make_embedder(a.embedder)
    vectors = np.ascontiguousarray(embed([t.strip() for t in passages]), dtype=np.float32)
    t = time.perf_counter()
    index = build_index(vectors, a.n_distractors, a.nlist, a.seed, a.near_distractors, a.near_cos)
    near = near_texts(len(passages), a.near_distractors)
    nprobe = a.nprobe or a.nlist
    print(f"index: {index.ntotal} vectors, {a.nlist} lists, built in {time.perf_counter() - t:.0f} s")
    queries = embed([item.question for item in items])
    probe = faiss.clone_index(index)
    probe.nprobe = nprobe
    t = time.perf_counter()
    _, ids = probe.search(queries, a.top_k)
    search_s = (time.perf_counter() - t) / len(items)
    print(f"one-thread search at nprobe={nprobe}: {search_s * 1000:.0f} ms")
    changes = stage_changes(index, queries, a.top_k, a.stages, nprobe)
    print_stage_changes(changes, nprobe, a.nlist)
    results: dict = {"config": dict(vars(a)), "search_s": search_s, "stage_changes": changes, "loads": []}
    if a.dry_run:
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))
        return 0
    engine = Engine.from_pretrained(a.model, **overrides)
    fmt = PromptFormat(engine.tokenizer)
    oracle = [texts_of(row, passages, near) for row in ids]
    bench = {
        "engine": engine,
        "format": fmt,
        "passages": passages,
        "near": near,
        "embed": embed,
        "index": index,
        "top_k": a.top_k,
        "stages": a.stages,
        "nprobe": nprobe,
        "oracle": oracle,
        "request": {"max_new_tokens": a.max_new_tokens, "temperature": 0.0},
    }
    try:
        service = _service_time(engine, fmt, items, oracle, bench["request"])
        print(f"cold request TTFT {service:.2f} s")
        results["service_s"] = service
        for load in (float(x) for x in a.loads.split(",")):
            rate = load / service
            rng = random.Random(a.seed)
            arrivals, at = [], 0.0
            for _ in items:
                arrivals.append(at)
                at += rng.expovariate(rate)
            runs = [run_arm(bench, arm, items, arrivals) for arm in arms]
            paired(runs)
            results["loads"].append({"load": load, "rate_per_s": rate, "arms": runs})
            _summary(load, rate, runs)
    finally:
        engine.close()
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


def _service_time(engine, fmt, items, oracle, request: dict) -> float:
    """A cold request's TTFT (the engine's service time; the second of two, on an emptied cache)."""
    ttft = 0.0
    for item, chunks in list(zip(items, oracle))[:2]:
        engine.store.clear()
        engine.variants.index.clear()
        suffix = f"{fmt.question_head}{item.question}{fmt.tail}"
        ttft = engine.generate(chunks, fmt.head, suffix, **request).ttft_s
    return ttft


def _summary(load: float, rate: float, runs: list[dict]) -> None:
    print(f"\nload {load} x service rate ({rate:.3f} req/s)")
    print("| arm | p50 TTFT s | p90 TTFT s | search s | non-overlapped s | adopted | wasted tokens | restarts |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['arm']} | {r['p50_ttft_s']:.3f} | {r['p90_ttft_s']:.3f} | {r['mean_search_s']:.3f} | "
            f"{r['mean_non_overlapped_s']:.3f} | {r['adoption_rate']:.0%} | {r['wasted_tokens']} | {r['restarts']} |"
        )
    # totals that queueing noise does not move, and TTFT paired per request with the `none` arm
    print(
        "\n| arm | prefill tokens | of them speculative, not adopted | engine busy s | makespan s | "
        "TTFT - none, median [p25, p75] s |"
    )
    print("|---|---|---|---|---|---|")
    for r in runs:
        diff = "—"
        if r.get("paired_median_s") is not None and r["arm"] != "none":
            diff = f"{r['paired_median_s']:+.3f} [{r['paired_p25_s']:+.3f}, {r['paired_p75_s']:+.3f}]"
        print(
            f"| {r['arm']} | {r['prefill_tokens']:,} | {r['speculation_tokens']:,} | {r['busy_s']:.1f} | "
            f"{r['makespan_s']:.1f} | {diff} |"
        )
