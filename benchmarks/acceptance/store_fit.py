"""Does workload (r)'s pool fit the default store? The passages of the first N dev questions, pooled
once each as workload (r) pools them (:class:`benchmarks.corpus.Corpus`), warmed the way
``--store corpus`` warms them (``corpus_order(..., "similar")``, then
``engine.warm(texts, order="similar", embeddings=...)``: each passage behind the ones most like it,
and a second variant of each from the reverse pass, kept ahead of need: speculative), into an
engine whose store settings are all defaults.

Reports the warm, the machine's memory and the budget sized from it, and the store's own stats
(entries, bytes, tokens, bytes per token, evictions, of which speculative ones, refusals), plus how
many passages have their first variant held and how many their second. Exits 1 unless every
passage's first variant is held and no entry was evicted but speculative ones no lookup had used.

    python -m benchmarks.acceptance.store_fit --dataset ../shared/data/musique_dev.json --n 40 \\
        --config num_threads=1 [--config kv_codec=int8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.corpus import EMBEDDERS, Corpus, corpus_order, make_embedder
from benchmarks.data import load_dataset
from kvrag import Engine
from kvrag.config import parse_overrides
from kvrag.engine.store.budget import machine_memory

STATS = ("entries", "bytes", "tokens", "bytes_per_token", "budget_bytes", "evictions", "speculative_evictions")


def variants_held(engine: Engine, texts: list[str]) -> list[tuple[list, list]]:
    """Per passage: ([(key, record)] of its first variant if held, [(key, record)] of its other variants held)."""
    out = []
    for text in texts:
        ids = engine.prompt_tokenizer.tokenize(text)
        key = engine.planner.chunk_key(ids)
        firsts, others = [], []
        for slot in engine.variants.index.keys(key) or [key]:
            rec = engine.store.peek(slot, ids)
            if rec is not None:
                (firsts if slot == key else others).append((slot, rec))
        out.append((firsts, others))
    return out


def summary(stats: dict, held: list[tuple[list, list]]) -> dict:
    mem = stats.get("memory", stats)  # a memory-only store's stats, or a tier stack's memory tier
    out = {k: mem.get(k) for k in STATS + ("rejected", "speculative_refused", "codec")}
    out["budget_used"] = out["bytes"] / out["budget_bytes"] if out["budget_bytes"] else None
    out["first_variants_held"] = sum(bool(f) for f, _ in held)
    out["second_variants_held"] = sum(len(o) for _, o in held)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--n", type=int, default=40, help="questions whose passages are pooled")
    ap.add_argument("--embedder", choices=EMBEDDERS, default="minilm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE", help="EngineConfig override")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)

    corpus = Corpus(load_dataset(args.dataset, args.n), make_embedder(args.embedder))
    texts, how = corpus_order(corpus, "similar", args.seed)
    engine = Engine.from_pretrained(**parse_overrides(args.config))
    t0 = time.perf_counter()
    warm = engine.warm(texts, progress=True, **how)
    engine.flush()
    seconds = time.perf_counter() - t0
    held = variants_held(engine, texts)
    st = engine.store.stats()
    layers, heads, dim = engine.variants.kv_shape
    total, available = machine_memory()
    report = {
        "questions": args.n,
        "passages": len(texts),
        "dtype": engine.config.dtype,
        "config": {k: getattr(engine.config, k) for k in ("memory_budget_bytes", "kv_codec", "warm_variants")},
        "machine": {"total_bytes": total, "available_bytes_after": available},
        "warm": {"computed": warm.computed, "variants": warm.variants, "tokens": warm.tokens, "seconds": seconds},
        "store": summary(st, held),
        "fp32_kv_bytes_per_token": 2 * layers * heads * dim * 4,
    }
    s = report["store"]
    report["checks"] = {
        "every passage's first variant held": s["first_variants_held"] == len(texts),
        "no entry a request kept evicted": s["evictions"] == s["speculative_evictions"] and s["rejected"] == 0,
    }
    engine.close()
    print(json.dumps(report, indent=2, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
