"""Measure the disk tier with the bundled model on dev passages.

``ttft``: time to first token of the same requests with their chunks in memory, on disk with
layer-wise prefetch, and on disk read whole before the prefill (interleaved, medians and ratios in
one run), plus the disk tier's load throughput. The page cache is warm (the entries were just
written), as in the acceptance criterion.

``restart``: process A warms the passages of a few dev questions into a disk tier and answers
them; a fresh process B, memory empty, answers the same questions; reports tiers and agreement.

    python -m benchmarks.acceptance.store_tiers ttft --dataset ../shared/data/musique_dev.json
    python -m benchmarks.acceptance.store_tiers restart --dataset ../shared/data/musique_dev.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.data import read_dataset_list
from kvrag import Engine, SamplingParams
from kvrag.engine.store import DiskStore, MemoryStore, TieredStore

PREFIX = "<|im_start|>system\nAnswer the question from the documents.<|im_end|>\n<|im_start|>user\n"


def tiered(directory: str) -> TieredStore:
    """Memory over a disk tier in ``directory`` (the model stays converted in the user cache)."""
    return TieredStore(MemoryStore(2 << 30), DiskStore(os.path.join(directory, "kv"), 1 << 34, "float16"), "float16")


def questions(path: str, n: int, k: int) -> list[tuple[list[str], str]]:
    data = read_dataset_list(Path(path))[:n]
    return [
        (
            [f"{c['title']}\n{c['text']}\n" for c in q["ctxs"][:k]],
            f"Question: {q['question']}<|im_end|>\n<|im_start|>assistant\n",
        )
        for q in data
    ]


def ttft(args) -> None:
    qs = questions(args.dataset, args.n, args.top_k)
    with tempfile.TemporaryDirectory() as tmp:
        eng = Engine.from_pretrained(
            store=tiered(tmp), write_back=False, loading_controller=False, sampling=SamplingParams(max_new_tokens=1)
        )
        t0 = time.perf_counter()
        for chunks, _ in qs:
            eng.warm(chunks)
        print(f"warmed {sum(len(c) for c, _ in qs)} chunks in {time.perf_counter() - t0:.0f} s", flush=True)
        times: dict[str, list[float]] = {"memory": [], "disk+prefetch": [], "disk, read whole": []}
        conds = list(times)
        for rep in range(args.reps):
            for qi, (chunks, question) in enumerate(qs):
                keys = [eng.planner.chunk_key(eng.prompt_tokenizer.tokenize(c)) for c in chunks]
                shift = (rep * len(qs) + qi) % len(conds)  # rotate the order: no condition always goes first
                for cond in conds[shift:] + conds[:shift]:
                    eng.store.prefetch = cond != "disk, read whole"
                    time.sleep(0.05)  # let the previous request's promotions land first
                    if cond == "memory":
                        eng.generate(chunks, PREFIX, question)  # make sure every chunk is (back) in memory
                    else:  # this question's chunks leave memory (prefix blocks stay)
                        for k in keys:
                            eng.store.memory.remove(k)
                    g = eng.generate(chunks, PREFIX, question)
                    tiers = {c.tier for c in g.stats.chunks}
                    assert tiers == {"memory" if cond == "memory" else "disk"}, (cond, tiers)
                    times[cond].append(g.ttft_s)
            print(
                f"rep {rep + 1}: " + ", ".join(f"{c} {statistics.median(t):.3f} s" for c, t in times.items()),
                flush=True,
            )
        med = {c: statistics.median(t) for c, t in times.items()}
        load = eng.store.stats()["load"]
        report = {
            "median_ttft_s": med,
            "ratio_vs_memory": {c: med[c] / med["memory"] for c in med},
            "load": load,
            "n_requests": len(qs) * args.reps,
            "chunks_per_request": args.top_k,
            "threads": __import__("torch").get_num_threads(),
        }
        print(json.dumps(report, indent=1))
        eng.close()


def _answer(dataset: str, n: int, k: int, cache_dir: str, warm: bool) -> list[dict]:
    eng = Engine.from_pretrained(
        store=tiered(cache_dir), loading_controller=False, sampling=SamplingParams(max_new_tokens=24)
    )
    out = []
    for chunks, question in questions(dataset, n, k):
        if warm:
            eng.warm(chunks)
        g = eng.generate(chunks, PREFIX, question)
        out.append({"text": g.text, "tiers": [c.tier for c in g.stats.chunks], "ttft_s": g.ttft_s})
    eng.close()
    return out


def restart(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        a = _answer(args.dataset, args.n, args.top_k, tmp, warm=True)
        b = json.loads(
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "restart-b",
                    "--dataset",
                    args.dataset,
                    "--n",
                    str(args.n),
                    "--top-k",
                    str(args.top_k),
                    "--dir",
                    tmp,
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
    tiers_b = [t for r in b for t in r["tiers"]]
    print(
        json.dumps(
            {
                "passages": len(tiers_b),
                "b_disk_hits": tiers_b.count("disk"),
                "same_answers": sum(x["text"] == y["text"] for x, y in zip(a, b)),
                "questions": len(a),
                "a": a,
                "b": b,
            },
            indent=1,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["ttft", "restart", "restart-b"])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir")
    args = ap.parse_args()
    if args.what == "ttft":
        ttft(args)
    elif args.what == "restart":
        restart(args)
    else:
        print(json.dumps(_answer(args.dataset, args.n, args.top_k, args.dir, warm=False)))


if __name__ == "__main__":
    main()
