"""CRAFT's replay: workload (r)'s retrieval stream, prefix hits against total hits, per chunk order.

Model-free: the stream is workload (r)'s (:mod:`benchmarks.corpus`: the first N questions' passages
pooled in a faiss index, the N first asks and their reworded returns, Zipf popularity over
questions, top-k per ask), replayed through the engine's own chunk-access table
(:class:`kvrag.engine.reuse.access.AccessTable`), with no model and no KV. Per window W and chunk
order, CRAFT's two metrics (§3.1), averaged over requests 2..N and normalised by k:

- ``prefix``: the longest common prefix with any earlier request (what exact prefix caching can reuse);
- ``total``: the most chunks shared with any earlier request, in any position (the reuse there is);
- ``gap_closed``: ``(prefix - prefix of retrieval order) / (total - prefix of retrieval order)``.

And the chunk-prefix tree the engine's promotion builds (the refresh keeps a prompt's leading run
of chunks whose counts reach tau): ``tree`` (chunks reused from it, share of k, prefix slicing
included) and ``tree_nodes`` (chunk sequences' nodes it holds: what the store keeps exactly), at
tau and at 1 (every retrieved sequence kept: the behaviour before promotion).

Orders (a policy sees only what the engine knows at request time: the window's counts and the
chunk sequences stored so far, never a later request):

- ``retrieval``: the retriever's;
- ``counts``: CRAFT's sort (descending count, ties in retrieval order): the first version of
  ``order="frequency"``;
- ``hysteresis``: ``counts``, except that among chunks within one count of the most retrieved
  remaining one, a chunk that continues a path of the promoted tree goes first;
- ``path-first``: a chunk that continues a path of the promoted tree always goes first (greedily,
  most retrieved first), then ``counts``;
- ``frequency``: the engine's ``order="frequency"`` (:meth:`AccessTable.order`): the longest
  stored path the retrieval's chunks can form first, then descending count, ties in retrieval order
  (the replay computes no KV, so no tie follows a computation order);
  its stored paths are every earlier request's sequence (as ``prefix`` mode's exact prefix cache,
  or write-back of missed chunks behind exact ones, keeps them);
- ``frequency-promoted``: the same, told only of the promoted tree's sequences (what the
  refresh alone keeps exactly: the conservative case).

``python -m benchmarks craft-replay --dataset ../shared/data/musique_dev.json --n 50 --requests 500``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.metrics import summarize
from kvrag.engine.reuse.access import AccessTable, frequency_order

__all__ = ["ORDERS", "replay", "main"]

#: Orders compared (module docstring): the retriever's, CRAFT's sort, two tree-aware variants of
#: it, and the engine's ``order="frequency"`` told of every stored sequence or only promoted ones.
ORDERS = ("retrieval", "counts", "hysteresis", "path-first", "frequency", "frequency-promoted")
#: Kinds of ask the tree hits are split by (an ask's occurrence 0, 1, 2 or more).
ASK_KINDS = ("first asks", "first returns", "later returns")


class _Tree:
    """A chunk-prefix tree of chunk ids (CRAFT's CP-tree), plain dicts."""

    def __init__(self) -> None:
        self.root: dict = {}
        self.nodes = 0

    def match(self, seq: list) -> int:
        node, n = self.root, 0
        for c in seq:
            if c not in node:
                break
            node, n = node[c], n + 1
        return n

    def insert(self, seq: list) -> None:
        node = self.root
        for c in seq:
            if c not in node:
                node[c] = {}
                self.nodes += 1
            node = node[c]

    def children(self, prefix: list) -> dict:
        node = self.root
        for c in prefix:
            node = node.get(c)
            if node is None:
                return {}
        return node


def _hysteresis(ids: list, counts: list[int], tree: _Tree, slack: float = 1) -> list[int]:
    """Frequency order, preferring among near-tied chunks (within ``slack`` counts of the most retrieved
    remaining one) one that continues a kept path."""
    left = frequency_order(counts)
    out: list[int] = []
    while left:
        top = counts[left[0]]
        kids = tree.children([ids[i] for i in out])
        pick = next((i for i in left if counts[i] >= top - slack and ids[i] in kids), left[0])
        out.append(pick)
        left.remove(pick)
    return out


def _lcp(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def replay(
    stream: list[list[int]], *, window: int | None, order: str, tau: int = 2, occurrences: list[int] | None = None
) -> dict:
    """Replay retrievals (chunk ids, in retrieval order) through an access table; CRAFT's metrics.

    ``occurrences`` (the asks' :attr:`~benchmarks.corpus.Ask.occurrence`, one per retrieval) adds
    the tree hits per kind of ask (:data:`ASK_KINDS`: first asks, a question's first return, its
    later returns), each averaged over that kind's requests and normalised by k.
    """
    table = AccessTable(window, tau)
    trees = {tau: _Tree(), 1: _Tree()}
    seen: list[list] = []
    prefix = total = 0.0
    tree_hits = {t: 0.0 for t in trees}
    by_kind = {t: {kind: [] for kind in ASK_KINDS} for t in trees}
    k = max(len(r) for r in stream)
    for n_req, ids in enumerate(stream):
        docs = [str(i) for i in ids]
        counts = table.counts("r", docs)
        if order == "retrieval":
            ranked = list(range(len(ids)))
        elif order == "counts":
            ranked = frequency_order(counts)
        elif order in ("frequency", "frequency-promoted"):
            ranked = table.order("r", docs, "frequency")
        elif order in ("hysteresis", "path-first"):  # a kept path leads whatever the counts, or among near-ties
            ranked = _hysteresis(ids, counts, trees[tau], float("inf") if order == "path-first" else 1)
        else:
            raise ValueError(f"unknown order {order!r}; use one of {ORDERS}")
        seq = [ids[i] for i in ranked]
        table.record("r", docs)
        if seen:
            prefix += max(_lcp(seq, prev) for prev in seen) / k
            here = set(seq)
            total += max(len(here.intersection(prev)) for prev in seen) / k
        for t, tree in trees.items():
            hit = tree.match(seq) / k
            if seen:
                tree_hits[t] += hit
            if occurrences is not None:
                by_kind[t][ASK_KINDS[min(occurrences[n_req], 2)]].append(hit)
            table_t = table if t == tau else None
            lead = table_t.promoted("r", [str(c) for c in seq]) if table_t is not None else len(seq)
            tree.insert(seq[:lead])
            told = (order == "frequency" and t == 1) or (order == "frequency-promoted" and t == tau)
            if told and lead:
                table.stored("r", [str(c) for c in seq[:lead]])  # what the engine is told it holds
        seen.append(seq)
    n = max(1, len(stream) - 1)
    kinds = {}
    if occurrences is not None:
        for t in trees:
            kinds[f"tree_tau{t}_by_ask"] = {kind: summarize(v)["mean"] for kind, v in by_kind[t].items()}
        kinds["asks"] = {kind: len(v) for kind, v in by_kind[tau].items()}
    return {
        "prefix": prefix / n,
        "total": total / n,
        f"tree_tau{tau}": tree_hits[tau] / n,
        f"tree_nodes_tau{tau}": trees[tau].nodes,
        "tree_tau1": tree_hits[1] / n,
        "tree_nodes_tau1": trees[1].nodes,
        "table_chunks": table.stats("r").chunks,
        **kinds,
    }


def _stream(
    dataset: str, n: int, requests: int, k: int, zipf: float, seed: int, embedder: str, skip: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Workload (r)'s retrievals (the top-k passage ids of each ask, in retrieval order) and each
    ask's occurrence; the questions are the dataset's ``n`` after the first ``skip``, as the bench's."""
    from benchmarks.corpus import Corpus, make_embedder, question_stream
    from benchmarks.data import load_dataset

    items = load_dataset(dataset, skip + n)[skip:]
    asks = question_stream(items, requests, zipf, seed)
    corpus = Corpus(items, make_embedder(embedder))
    return corpus.search([a.text for a in asks], k), [a.occurrence for a in asks]


def _print_by_ask(rows: list[dict], tau: int) -> None:
    """Tree hits per kind of ask: what the promoted tree (tau) and the keep-everything tree (1) give
    a first ask, a question's first return and its later returns, in the orders that follow them."""
    counts = rows[0]["asks"]
    print(f"\nTree hits by kind of ask (share of k; asks: {', '.join(f'{n} {kind}' for kind, n in counts.items())})\n")
    print("| W | order | tree | " + " | ".join(ASK_KINDS) + " |")
    print("|---|---|---|" + "---|" * len(ASK_KINDS))
    for r in rows:
        if r["order"] not in ("retrieval", "frequency-promoted", "frequency"):
            continue
        for t in (tau, 1):
            cells = [r[f"tree_tau{t}_by_ask"][kind] for kind in ASK_KINDS]
            shown = " | ".join("" if c is None else f"{c:.3f}" for c in cells)
            print(f"| {r['window'] or 'unbounded'} | {r['order']} | tau={t} | {shown} |")


def _window(text: str) -> int | None:
    return None if text in ("none", "unbounded", "inf") else int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks craft-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--n", type=int, default=50, help="questions pooled (workload r's --n)")
    p.add_argument("--skip", type=int, default=0, help="questions skipped first (held-out halves: --skip 20 --n 20)")
    p.add_argument("--requests", type=int, default=500, help="stream length (first asks + reworded returns)")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--embedder", choices=("minilm", "lexical"), default="minilm")
    p.add_argument("--windows", default="16,64,1000,unbounded", help="comma-separated W; 'unbounded' for none")
    p.add_argument("--tau", type=int, default=2, help="promotion threshold")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    if a.skip < 0:
        p.error("--skip must be >= 0")
    stream, occurrences = _stream(a.dataset, a.n, a.requests, a.top_k, a.zipf, a.seed, a.embedder, a.skip)
    rows = []
    for w in [_window(x.strip()) for x in a.windows.split(",")]:
        base = None
        for order in ORDERS:
            row = {
                "window": w,
                "order": order,
                **replay(stream, window=w, order=order, tau=a.tau, occurrences=occurrences),
            }
            base = row if order == "retrieval" else base
            gap = row["total"] - base["prefix"]
            row["gap_closed"] = (row["prefix"] - base["prefix"]) / gap if gap > 0 else None
            rows.append(row)
    tau = a.tau
    print(
        f"workload (r) replay: {len(stream)} requests, top-{a.top_k}, {a.n} questions after {a.skip}, Zipf {a.zipf}, "
        f"seed {a.seed}, {a.embedder} embeddings, tau {tau} ({time.perf_counter() - t0:.1f} s)\n"
    )
    print(
        f"| W | order | prefix | total | gap closed | tree hits, tau={tau} | tree nodes, tau={tau} "
        "| tree hits, tau=1 | tree nodes, tau=1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gap = "" if r["gap_closed"] is None or r["order"] == "retrieval" else f"{r['gap_closed']:.0%}"
        print(
            f"| {r['window'] or 'unbounded'} | {r['order']} | {r['prefix']:.3f} | {r['total']:.3f} | {gap} "
            f"| {r[f'tree_tau{tau}']:.3f} | {r[f'tree_nodes_tau{tau}']} "
            f"| {r['tree_tau1']:.3f} | {r['tree_nodes_tau1']} |"
        )
    _print_by_ask(rows, tau)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0
