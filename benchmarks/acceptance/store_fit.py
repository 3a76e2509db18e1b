"""Does workload (r)'s pool fit the default store? The passages of the first N dev questions, pooled
once each as workload (r) pools them (:class:`benchmarks.corpus.Corpus`), warmed the way
``--store corpus`` warms them (``corpus_order(..., "similar")``, then
``engine.warm(texts, order="similar", embeddings=...)``: each passage behind the ones most like it,
a second variant from the reverse pass), into an engine whose store settings are all defaults.

Reports the warm, the machine's memory and the budget sized from it, and the store's own stats:
entries, bytes, tokens, bytes per token, evictions, records refused, second variants refused
(``speculative_refused``: a variant kept ahead of need only takes free room, it never evicts).
Exits 1 if an entry was evicted or refused, or if a token costs more than half of float32 KV.

    python -m benchmarks.acceptance.store_fit --dataset ../shared/data/musique_dev.json --n 40 \\
        --config num_threads=1 [--config kv_codec=plain] [--json out.json]
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
    passage_tokens = sum(len(engine.prompt_tokenizer.tokenize(t)) for t in texts)
    t0 = time.perf_counter()
    warm = engine.warm(texts, progress=True, **how)
    engine.flush()
    seconds = time.perf_counter() - t0
    st = engine.store.stats()
    mem = st.get("memory", st)  # a memory-only store's stats, or a tier stack's memory tier
    kv_shape = engine.variants.kv_shape
    fp32_per_token = 2 * kv_shape[0] * kv_shape[1] * kv_shape[2] * 4
    total, available = machine_memory()
    report = {
        "questions": args.n,
        "passages": len(texts),
        "passage_tokens": passage_tokens,
        "dtype": engine.config.dtype,
        "config": {k: getattr(engine.config, k) for k in ("memory_budget_bytes", "kv_codec", "warm_variants")},
        "codec": st.get("codec", mem.get("codec")),
        "machine": {"total_bytes": total, "available_bytes_after": available},
        "warm": {"computed": warm.computed, "variants": warm.variants, "tokens": warm.tokens, "seconds": seconds},
        "store": {
            k: mem.get(k)
            for k in (
                "entries",
                "bytes",
                "tokens",
                "bytes_per_token",
                "budget_bytes",
                "evictions",
                "rejected",
                "speculative_refused",
            )
        },
        "fp32_bytes_per_token": fp32_per_token,
    }
    s = report["store"]
    s["budget_used"] = s["bytes"] / s["budget_bytes"] if s["budget_bytes"] else None
    checks = {
        "no eviction": s["evictions"] == 0 and s["rejected"] == 0,
        "every passage held": s["entries"] >= len(texts),
        "bytes per token <= half of float32": s["bytes_per_token"] is not None
        and s["bytes_per_token"] <= fp32_per_token / 2,
    }
    report["checks"] = checks
    engine.close()
    print(json.dumps(report, indent=2, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
