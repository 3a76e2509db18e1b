"""A LlamaIndex RAG query engine, with and without kvrag: answers and time to first token.

Offline: bundled SmolLM2-135M-Instruct, bundled MiniLM embeddings, a faiss index. The vector
store is faiss (``IndexFlatIP``, exact inner product over normalised MiniLM vectors) because that
is what kvrag's examples standardise on and what a production LlamaIndex app would plug in; the
default in-memory store would give the same top-k here, only slower at scale.

Data: the 500 dev passages pooled from ``../shared/data/musique_dev.json`` when present (it is
never copied into the repo), else (or with ``--data handbook``) the six documents of
``examples/data/handbook.json``. Two questions whose top-6 share at least four passages, in another
order, are asked: the first cold, the second reusing the shared passages' KV. The same questions go
through the same query engine with ``mode="full"`` (a plain full prefill) for the baseline.

    python examples/llama_index_rag.py [--data PATH|handbook] [--response-mode compact|tree_summarize] [--repeats N]

It ends with the acceptance checks of issue 4 for a LlamaIndex query engine (PASS/FAIL lines):
>= 4 chunk hits on Q2, TTFT(Q2) <= 0.35 x TTFT(cold Q1), ROUGE-L(kvrag, full) >= 0.85. Timings
mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # _compare beside this file, whatever the working directory

from _compare import question_pair, rouge_l  # noqa: E402

MUSIQUE = HERE.parent.parent / "shared" / "data" / "musique_dev.json"
HANDBOOK_QUESTIONS = ("Who built the lighthouse at Gull Point?", "When was the Port Alder lighthouse first lit?")
TOP_K = 6


def load_data(path: str | None) -> tuple[list[str], list[str], str]:
    """(passages, questions, source name): pooled musique passages, else (or for ``"handbook"``) the
    bundled handbook."""
    path = path or (MUSIQUE if MUSIQUE.is_file() else None)
    if path is not None and path != "handbook":
        path = Path(path)
        rows = json.loads(path.read_text())
        passages = list(dict.fromkeys(c["text"] for row in rows for c in row["ctxs"]))  # dedup, keep order
        return passages, [row["question"] for row in rows], f"{path.name} ({len(passages)} unique passages)"
    docs = json.loads((HERE / "data" / "handbook.json").read_text())
    return [f"{d['title']}\n{d['text']}" for d in docs], list(HANDBOOK_QUESTIONS), "examples/data/handbook.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data",
        default=None,
        help="musique-style JSON, or 'handbook' for examples/data/handbook.json "
        "(default: ../shared/data/musique_dev.json if present, else the handbook)",
    )
    ap.add_argument("--response-mode", default="compact", choices=["compact", "tree_summarize"])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--recompute-ratio", type=float, default=None, help="kvrag's blend ratio (default: config)")
    ap.add_argument("--repeats", type=int, default=1, help="cold/warm rounds (TTFT medians)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed full-prefill queries first")
    args = ap.parse_args()

    import faiss
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.vector_stores.faiss import FaissVectorStore

    from kvrag.integrations.llama_index import KVCachedLLM, minilm_embedding, record_stats

    passages, questions, source = load_data(args.data)
    print(f"Data: {source}")
    embed = minilm_embedding()
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(len(embed.get_query_embedding("dimension probe"))))
    index = VectorStoreIndex(
        [TextNode(text=p, id_=f"p{i}") for i, p in enumerate(passages)],
        storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=embed,
    )
    top_k = min(TOP_K, len(passages))
    retriever = index.as_retriever(similarity_top_k=top_k)
    tops = [[n.node.node_id for n in retriever.retrieve(q)] for q in questions]
    q1, q2, shared = question_pair(questions, tops)
    print(f"Q1: {q1}\nQ2: {q2}\n    (their top-{top_k} share {shared} passages, in another order)\n")

    # The one-line change: KVCachedLLM, plus a postprocessor that registers the retrieved nodes.
    kv = KVCachedLLM(max_new_tokens=args.max_new_tokens, recompute_ratio=args.recompute_ratio)
    full = KVCachedLLM(max_new_tokens=args.max_new_tokens, mode="full")  # same shared engine, full prefill
    print("Loading the bundled model (the first run converts it once, ~30 s)...")

    def engine_for(llm):
        return index.as_query_engine(
            llm=llm,
            similarity_top_k=top_k,
            response_mode=args.response_mode,
            node_postprocessors=[kv.node_postprocessor()],
        )

    def ask(llm, question):
        with record_stats() as calls:
            answer = str(engine_for(llm).query(question)).strip()
        return answer, calls[-1], calls

    # Warm up outside every timing (the process's first long forward pass pays one-time costs), in
    # full mode, which caches nothing.
    for _ in range(args.warmup):
        ask(full, q1)

    # Rounds interleave kvrag and the full-prefill baseline; each round starts cold (the KV store,
    # prefix blocks included, is cleared). Timings are medians over the rounds.
    rounds = []
    for _ in range(args.repeats):
        kv.engine.store.clear()
        r = {"kv1": ask(kv, q1)}  # cold: every passage is a miss
        kv.engine.flush()  # the misses' KV is written back in the background; wait for it
        r["full1"], r["full2"], r["kv2"] = ask(full, q1), ask(full, q2), ask(kv, q2)
        rounds.append(r)

    last = rounds[-1]
    for label, key_full, key_kv in (("Q1 (cold)", "full1", "kv1"), ("Q2", "full2", "kv2")):
        fa, fs, _ = last[key_full]
        ka, ks, calls = last[key_kv]
        print(f"{label}")
        print(f"  full prefill  TTFT {median(rounds, key_full):6.2f} s : {fa}")
        print(f"  kvrag         TTFT {median(rounds, key_kv):6.2f} s : {ka}")
        print(
            f"  {ks['chunk_hits']} chunk hits, {ks['chunk_misses']} misses; {ks['cache_read']}/{ks['prompt_tokens']} "
            f"prompt tokens from cache, {ks['recomputed_tokens']} recomputed; {len(calls)} LLM call(s)"
        )
        print(f"  ROUGE-L kvrag vs full: {rouge_l(ka, fa):.3f}\n")
    ratio = median(rounds, "kv2") / median(rounds, "kv1")
    hits = [r["kv2"][1]["chunk_hits"] for r in rounds]
    score = rouge_l(last["kv2"][0], last["full2"][0])
    print(
        f"TTFT medians over {len(rounds)} round(s); Q2 kvrag / Q2 full prefill: "
        f"{median(rounds, 'kv2') / median(rounds, 'full2'):.3f}"
    )
    check("Q2 chunk hits", min(hits) >= 4, f"{hits} (need >= 4)")
    check("TTFT Q2 / cold Q1 (kvrag)", ratio <= 0.35, f"{ratio:.3f} (need <= 0.35)")
    check("ROUGE-L Q2 kvrag vs mode=full", score >= 0.85, f"{score:.3f} (need >= 0.85)")


def median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key][1]["ttft_s"] for r in rounds)


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")


if __name__ == "__main__":
    main()
