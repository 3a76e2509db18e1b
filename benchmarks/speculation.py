"""RAGCache's dynamic speculative pipelining: TTFT from the query's arrival, search included.

    python -m benchmarks speculation [--dataset musique_dev.json] [--n 40] [--n-distractors 1000000]
                        [--nlist 1024] [--nprobe 1024] [--stages 4] [--loads 0.1,1.5] [--top-k 6]
                        [--arms none,dynamic,always,chunks,oracle] [--embedder minilm] [--config F=V ...]

The corpus is the dev questions' passages plus ``--n-distractors`` synthetic unit vectors (random
directions: they are never near a question, they only make the search slow), in one IVF index
(inner product) scanned at ``--nprobe`` lists in ``--stages`` stages
(:mod:`kvrag.integrations.staged_search`). Requests arrive as a Poisson process at each
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
(speculations started and not adopted) and the adoption rate. The honest ceiling of any
speculation is (search + TTFT) / TTFT of the ``none`` arm.

Threads (2 cores): torch gets ``--config num_threads=1`` by default and faiss one OpenMP thread,
so a search and a prefill each hold one core (docs/benchmarks.md, "Threads on a small machine").
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

__all__ = ["ARMS", "build_index", "run_arm", "main"]

ARMS = ("none", "dynamic", "always", "chunks", "oracle")


def build_index(passages: np.ndarray, n_distractors: int, nlist: int, seed: int):
    """An IVF inner-product index of the passages (ids 0..P-1) and random unit distractors after them."""
    import faiss

    d = passages.shape[1]
    rng = np.random.default_rng(seed)
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
    train = [passages]
    sample = min(n_distractors, max(40 * nlist, 10_000))
    if sample:
        train.append(_unit(rng.standard_normal((sample, d), dtype=np.float32)))
    index.train(np.concatenate(train))
    index.add(passages)
    for start in range(0, n_distractors, 100_000):  # in blocks: a 1M x 384 float block is 1.5 GB at once
        block = min(100_000, n_distractors - start)
        index.add(_unit(rng.standard_normal((block, d), dtype=np.float32)))
    return index


def _unit(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)


class _Request(threading.Thread):
    """One request's life from its arrival: embed, staged search (speculating per the arm), stream."""

    def __init__(self, bench: dict, rid: int, item, arrival: float, arm: str) -> None:
        super().__init__(daemon=True)
        self.bench, self.rid, self.item, self.arrival, self.arm = bench, rid, item, arrival, arm
        self.row: dict = {}

    def run(self) -> None:
        from kvrag.integrations.staged_search import staged_search

        b, arm = self.bench, self.arm
        engine, fmt, passages = b["engine"], b["format"], b["passages"]
        wait = self.arrival - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        t0 = time.perf_counter()
        suffix = f"{fmt.question_head}{self.item.question}{fmt.tail}"
        spec, speculated, stages = None, None, 0

        def chunks_of(ids) -> list[str]:
            return [passages[int(i)] for i in ids if 0 <= i < len(passages)]

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
                    engine.speculate(speculated, key=self.rid)
                else:
                    spec = engine.speculate_request(
                        speculated, fmt.head, suffix, key=self.rid, dynamic=arm == "dynamic", **b["request"]
                    )
            search_end = time.perf_counter()
            if spec is not None and speculated != final:
                spec.cancel()  # Algorithm 2: the final list differs from the speculated one
        stream = engine.stream(final, fmt.head, suffix, **b["request"])
        first = None
        for _ in stream:
            if first is None:
                first = time.perf_counter()
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
        }


def run_arm(bench: dict, arm: str, items: list, arrivals: list[float]) -> dict:
    """Replay the arrivals on an emptied cache; the arm's rows and totals."""
    engine = bench["engine"]
    engine.flush()
    engine.store.clear()
    engine.variants.index.clear()
    before = dict(engine.speculations.counts)
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
    }


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
    faiss.omp_set_num_threads(1)
    overrides = {"num_threads": 1, **command_line_overrides(a.config)}
    items = load_dataset(a.dataset, a.n)
    passages = sorted({t for item in items for t in item.passages})
    embed = make_embedder(a.embedder)
    vectors = np.ascontiguousarray(embed([t.strip() for t in passages]), dtype=np.float32)
    t = time.perf_counter()
    index = build_index(vectors, a.n_distractors, a.nlist, a.seed)
    nprobe = a.nprobe or a.nlist
    print(f"index: {index.ntotal} vectors, {a.nlist} lists, built in {time.perf_counter() - t:.0f} s")
    engine = Engine.from_pretrained(a.model, **overrides)
    fmt = PromptFormat(engine.tokenizer)
    queries = embed([item.question for item in items])
    probe = faiss.clone_index(index)
    probe.nprobe = nprobe
    t = time.perf_counter()
    _, ids = probe.search(queries, a.top_k)
    search_s = (time.perf_counter() - t) / len(items)
    oracle = [[passages[int(i)] for i in row if 0 <= i < len(passages)] for row in ids]
    bench = {
        "engine": engine,
        "format": fmt,
        "passages": passages,
        "embed": embed,
        "index": index,
        "top_k": a.top_k,
        "stages": a.stages,
        "nprobe": nprobe,
        "oracle": oracle,
        "request": {"max_new_tokens": a.max_new_tokens, "temperature": 0.0},
    }
    results: dict = {"config": dict(vars(a)), "search_s": search_s, "loads": []}
    try:
        service = _service_time(engine, fmt, items, oracle, bench["request"])
        print(f"one-thread search at nprobe={nprobe}: {search_s * 1000:.0f} ms; cold request TTFT {service:.2f} s")
        results["service_s"] = service
        for load in (float(x) for x in a.loads.split(",")):
            rate = load / service
            rng = random.Random(a.seed)
            arrivals, at = [], 0.0
            for _ in items:
                arrivals.append(at)
                at += rng.expovariate(rate)
            runs = [run_arm(bench, arm, items, arrivals) for arm in arms]
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
