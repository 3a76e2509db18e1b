"""Steady state of the chunk store under a Zipf stream of RAG requests: LRU vs PGDSF, one run.

Five hundred real prefills of the bundled model take hours on a shared 2-core CPU, so the stream
is replayed against the real store code (``TieredStore`` over a ``MemoryStore`` with the policy and
a ``DiskStore`` in a temporary directory) with the chunks' real token ids and sizes, and with time
taken from the engine's own measured cost profile:

- each chunk's record holds its real token ids and K/V of ``BYTES_PER_TOKEN`` bytes per token, so
  byte sizes are the real ones scaled by one constant; budgets are fractions of the stream's
  working set and mean the same as at full scale;
- a request's TTFT is ``max(T(cached, computed), T_load)``: ``T`` from the measured profile
  (bilinear), ``T_load`` its disk hits' full-scale bytes over the measured disk throughput
  (prefetch overlaps loading with compute);
- its speedup is ``T(0, n) / TTFT``: a full prefill of the same prompt over the request's TTFT.

Run ``python -m benchmarks store-sim --dataset DEV.json --out DIR`` (from a clone;
it measures the profile with the bundled model first, or takes ``--profile DIR/profile.json`` from
an earlier run).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.data import read_dataset_list
from kvrag.engine.store import serial
from kvrag.engine.store.base import KVRecord, chunk_key
from kvrag.engine.store.disk import DiskStore
from kvrag.engine.store.memory import MemoryStore
from kvrag.engine.store.profile import CostProfile
from kvrag.engine.store.tiered import TieredStore

__all__ = ["zipf_stream", "measure", "simulate", "summarize", "main"]

BYTES_PER_TOKEN_DIM = 32  # K/V head dim of the scaled records: 2 x 32 x 2 bytes = 128 bytes per token


def pooled_passages(dataset: str, tokenizer) -> tuple[list[str], list[list[int]], int]:
    """Unique passages of a QA file (``title\\ntext``), their token ids, and mean question tokens."""
    data = read_dataset_list(Path(dataset))
    texts = list(dict.fromkeys(f"{c['title']}\n{c['text']}\n" for q in data for c in q["ctxs"]))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    q = sum(len(tokenizer(d["question"])["input_ids"]) for d in data) // len(data)
    return texts, ids, q


def zipf_stream(n_items: int, n_requests: int, k: int, s: float = 1.0, seed: int = 0) -> list[list[int]]:
    """Requests of ``k`` distinct items each, items drawn by Zipf popularity (rank^-s, ranks shuffled)."""
    rng = random.Random(seed)
    ranks = list(range(n_items))
    rng.shuffle(ranks)
    weights = [1.0 / (r + 1) ** s for r in ranks]
    out = []
    for _ in range(n_requests):
        req: list[int] = []
        while len(req) < k:
            i = rng.choices(range(n_items), weights)[0]
            if i not in req:
                req.append(i)
        out.append(req)
    return out


def measure(engine, texts: list[str], k: int, question: str, cache_dir: str, reps: int = 2) -> dict:
    """The engine's cost profile over prompts of ``k`` chunks with 0..k hits, and its disk throughput."""
    from kvrag import Engine

    eng = Engine.from_model(
        engine.hf_model,
        engine.tokenizer,
        config=engine.config.replace(
            disk_tier=True, cache_dir=cache_dir, write_back=False, prefix_cache=False, loading_controller=False
        ),
    )
    rng = random.Random(1)
    pool = rng.sample(texts, k * (k + 1) * reps)
    for n, hits in enumerate(h for h in range(k + 1) for _ in range(reps)):
        chunks = pool[n * k : (n + 1) * k]
        eng.warm(chunks[:hits])
        if n % 2:  # every other request reads its hits from disk: that measures the disk's throughput
            eng.store.memory.clear()
        g = eng.generate(chunks, "", question, max_new_tokens=1)
        print(f"  profile: {hits}/{k} hits, {g.stats.prompt_tokens} tokens, {g.ttft_s:.2f} s", flush=True)
    out = {
        "profile": eng.costs.profile.to_dict(),
        "throughput": eng.store.meter.throughput(),
        "kv_bytes_per_token": engine.adapter.kv_bytes_per_token
        * eng.store.dtype.itemsize
        // engine.adapter.embed_weight.element_size(),
    }
    eng.close()
    return out


def _record(ids: list[int]) -> KVRecord:
    t = torch.zeros(1, 1, len(ids), BYTES_PER_TOKEN_DIM, dtype=torch.float16)
    return KVRecord(torch.tensor(ids), t, t.clone())


def simulate(
    passages: list[list[int]],
    stream: list[list[int]],
    policy: str,
    measured: dict,
    *,
    memory_fraction: float,
    disk_fraction: float | None,
    extra_tokens: int,
    workdir: str,
) -> list[dict]:
    """Replay ``stream`` against a store with ``policy`` in memory (and a disk tier unless
    ``disk_fraction`` is ``None``); one dict per request."""
    profile = CostProfile.from_dict(measured["profile"])
    full_bpt, tput = measured["kv_bytes_per_token"], measured["throughput"]
    used = sorted({i for req in stream for i in req})
    working = sum(_record(passages[i]).nbytes for i in used)
    on_disk = sum(
        len(serial.encode(chunk_key("sim", "fp", passages[i]), _record(passages[i]), torch.float16)) for i in used
    )
    disk = None
    if disk_fraction is not None:
        disk_budget = int(disk_fraction * on_disk) + 65536 + 512 * len(used)  # plus the SQLite index
        disk = DiskStore(Path(workdir) / f"{policy}-{disk_fraction}", disk_budget, policy=policy)
    store = TieredStore(MemoryStore(int(memory_fraction * working), policy), disk, "float16", prefetch=False)
    out = []
    for req in stream:
        tiers, missed, cached, load_bytes = [], [], 0, 0
        for i in req:
            key = chunk_key("sim", "fp", passages[i])
            rec = store.get(key, passages[i])
            tiers.append(rec.tier if rec is not None else "miss")
            if rec is None:
                missed.append(i)
            else:
                cached += len(passages[i])
                if rec.tier == "disk":
                    load_bytes += len(passages[i]) * full_bpt
        n = sum(len(passages[i]) for i in req) + extra_tokens
        compute = profile.estimate(cached, n - cached)
        ttft = max(compute, load_bytes / tput if tput else 0.0)
        if missed:
            store.record_cost([chunk_key("sim", "fp", passages[i]) for i in missed], compute / (n - cached))
        for i in missed:  # write-back after the first token
            store.put(chunk_key("sim", "fp", passages[i]), _record(passages[i]))
        st = store.stats()
        out.append(
            {
                "tiers": tiers,
                "ttft": ttft,
                "speedup": profile.estimate(0, n) / ttft,
                "memory_bytes": st["memory"]["bytes"],
                "memory_budget": st["memory"]["budget_bytes"],
                "disk_bytes": st["disk"]["bytes"] if disk else 0,
                "disk_budget": disk_budget if disk else 0,
            }
        )
    store.close()
    return out


def summarize(results: list[dict], windows: int = 5) -> list[dict]:
    """Hit rates (all tiers, memory) and mean speedup per consecutive fifth of the stream."""
    n = len(results)
    rows = []
    for w in range(windows):
        part = results[w * n // windows : (w + 1) * n // windows]
        tiers = [t for r in part for t in r["tiers"]]
        rows.append(
            {
                "window": w + 1,
                "hit_rate": sum(t != "miss" for t in tiers) / len(tiers),
                "memory_hit_rate": sum(t == "memory" for t in tiers) / len(tiers),
                "speedup": sum(r["speedup"] for r in part) / len(part),
                "ttft": sorted(r["ttft"] for r in part)[len(part) // 2],
            }
        )
    return rows


def plot(series: dict[str, list[dict]], path: Path, window: int = 50) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in series.items():
        hit = [sum(t != "miss" for t in r["tiers"]) / len(r["tiers"]) for r in res]
        mem = [sum(t == "memory" for t in r["tiers"]) / len(r["tiers"]) for r in res]
        sp = [r["speedup"] for r in res]

        def avg(xs):
            return [
                sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1])
                for i in range(len(xs))
            ]

        axes[0].plot(avg(hit), label=f"{name}: any tier")
        if "disk" in name:
            axes[0].plot(avg(mem), "--", label=f"{name}: memory")
        axes[1].plot(avg(sp), label=name)
    axes[0].set(title=f"chunk hit rate (moving mean of {window})", xlabel="request", ylim=(0, 1))
    axes[1].set(title=f"TTFT speedup over full prefill (moving mean of {window})", xlabel="request")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks store-sim``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks store-sim", description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", help="profile.json from an earlier run (skips measuring)")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--memory-fraction", type=float, default=0.15)
    ap.add_argument("--disk-fraction", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from kvrag import Engine

    engine = Engine.from_pretrained()
    texts, passages, qlen = pooled_passages(args.dataset, engine.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            measured = json.loads(Path(args.profile).read_text())
        else:
            t0 = time.perf_counter()
            measured = measure(engine, texts, args.top_k, "Question: who founded the city?\nAnswer:", tmp)
            print(f"profile measured in {time.perf_counter() - t0:.0f} s")
            (out / "profile.json").write_text(json.dumps(measured))
        stream = zipf_stream(len(passages), args.requests, args.top_k, args.zipf, args.seed)
        series = {}
        for disk in (None, args.disk_fraction):  # memory alone (the default config), then memory + disk
            for p in ("lru", "pgdsf"):
                series[p + ("+disk" if disk else "")] = simulate(
                    passages,
                    stream,
                    p,
                    measured,
                    memory_fraction=args.memory_fraction,
                    disk_fraction=disk,
                    extra_tokens=qlen + 20,
                    workdir=tmp,
                )
    report = {
        "args": vars(args),
        "passages": len(passages),
        "throughput": measured["throughput"],
        "summary": {p: summarize(r) for p, r in series.items()},
        "within_budget": {
            p: all(r["memory_bytes"] <= r["memory_budget"] and r["disk_bytes"] <= r["disk_budget"] for r in res)
            for p, res in series.items()
        },
    }
    for p, rows in report["summary"].items():
        report.setdefault("steady", {})[p] = rows[-1]["speedup"] / rows[1]["speedup"]
    (out / "steady.json").write_text(json.dumps(report, indent=1))
    (out / "series.json").write_text(json.dumps(series))
    plot(series, out / "steady.png")
    for p, rows in report["summary"].items():
        print(
            p,
            " ".join(
                f"[{r['window']}] hit {r['hit_rate']:.2f} mem {r['memory_hit_rate']:.2f} x{r['speedup']:.2f}"
                for r in rows
            ),
            f"last/second {report['steady'][p]:.2f}",
        )
    print("within budget:", report["within_budget"])
    return 0
