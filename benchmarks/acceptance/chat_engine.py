"""Acceptance of a LlamaIndex ``condense_plus_context`` chat engine (issue 34): no call slower than full.

A chat engine over ``KVCachedLLM(conversation_id=...)`` makes two calls a turn from the second
turn on: it condenses the question with the history (a side call: it does not continue the
conversation) and answers it over the retrieved passages with the history (the conversation's next
turn, docs-first: the passages change, the history follows them). Each turn runs twice, paired:
in the kvrag chat engine and in the same chat engine over ``KVCachedLLM(mode="full")`` (its own
conversation id), and every call's TTFT is compared with the same call's under ``mode="full"``.
Write-back is flushed after each kvrag turn, before the full one is timed.

Passages: those of the dev questions ``--skip`` .. ``--skip + --n`` (held out: ``--skip 20``) in a
faiss index of bundled-MiniLM vectors; conversation ``c`` asks questions ``c * turns`` ... in order.
Check: every call's TTFT x full <= ``--max-ratio`` (1.05); prints each call, exits 1 if one fails.
Timings mean something only on a quiet machine.

    python -m benchmarks.acceptance.chat_engine [--data PATH] [--skip 20] [--n 20]
        [--conversations 2] [--turns 3] [--top-k 6] [--max-tokens 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from _rag_data import dataset_path  # noqa: E402

from benchmarks.corpus import Corpus, make_embedder  # noqa: E402
from benchmarks.data import load_dataset  # noqa: E402

#: The figures of each call kept in the rows (beside the TTFTs).
FIELDS = ("prompt_tokens", "cache_read", "conversation_tokens", "chunk_hits", "chunks_found", "path", "path_reason")


def chat_engines(corpus: Corpus, k: int, max_tokens: int, conversation: str):
    """The two chat engines of one conversation: kvrag's and the full prefill's, over one index."""
    import faiss
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.vector_stores.faiss import FaissVectorStore

    from kvrag.integrations.llama_index import KVCachedLLM, minilm_embedding

    nodes = [
        TextNode(text=p.strip(), id_=f"p{i}", embedding=corpus.vectors[i].tolist())
        for i, p in enumerate(corpus.passages)
    ]
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(corpus.vectors.shape[1]))
    index = VectorStoreIndex(
        nodes, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=minilm_embedding()
    )
    llms = {
        "kvrag": KVCachedLLM(max_new_tokens=max_tokens, conversation_id=conversation),
        "full": KVCachedLLM(max_new_tokens=max_tokens, mode="full", conversation_id=f"{conversation}-full"),
    }
    post = llms["kvrag"].node_postprocessor()  # registers the retrieved passages with the engine
    engines = {
        which: index.as_chat_engine(
            chat_mode="condense_plus_context", llm=llm, similarity_top_k=k, node_postprocessors=[post]
        )
        for which, llm in llms.items()
    }
    return engines, llms["kvrag"].engine


def run(items, corpus: Corpus, args) -> list[dict]:
    """Every call of every turn of every conversation, paired with the same call under ``mode="full"``."""
    from kvrag.integrations.llama_index import record_stats

    rows: list[dict] = []
    for c in range(args.conversations):
        engines, engine = chat_engines(corpus, args.top_k, args.max_tokens, f"chat-{c}")
        if c == 0:
            engines["full"].chat("Say hello.")  # load and warm the engine up; not part of any figure
            engines["full"].reset()
            engine.flush()
            engine.store.clear()  # a cold start: chunk KV comes only from the chats' own write-back
        questions = [it.question for it in items[c * args.turns : (c + 1) * args.turns]]
        for turn, question in enumerate(questions, 1):
            calls = {}
            for which in ("kvrag", "full"):
                with record_stats() as got:
                    engines[which].chat(question)
                calls[which] = got
                engine.flush()  # the kvrag turn's write-back off the clock, before the reference is timed
            if len(calls["kvrag"]) != len(calls["full"]):
                raise RuntimeError(f"turn {turn}: {len(calls['kvrag'])} kvrag calls against {len(calls['full'])}")
            for i, (mine, ref) in enumerate(zip(calls["kvrag"], calls["full"])):
                row = {
                    "conversation": c,
                    "turn": turn,
                    "call": i,
                    "kind": "answer" if i == len(calls["kvrag"]) - 1 else "condense",
                }
                row.update({f: mine.get(f) for f in FIELDS})
                row.update(ttft_s=mine["ttft_s"], full_ttft_s=ref["ttft_s"], ratio=mine["ttft_s"] / ref["ttft_s"])
                rows.append(row)
                print(
                    f"conversation {c} turn {turn} {row['kind']:8s}: {row['prompt_tokens']:5d} tokens, "
                    f"TTFT {row['ttft_s']:.3f} s against {row['full_ttft_s']:.3f} s full (x{row['ratio']:.2f}); "
                    f"path {row['path']} ({row['path_reason']}), cache read {row['cache_read']} "
                    f"({row['conversation_tokens']} from the conversation)",
                    flush=True,
                )
    return rows


def check(rows: list[dict], max_ratio: float) -> bool:
    """Print the verdict: every call within ``max_ratio`` of the same call under ``mode="full"``."""
    worst = max(rows, key=lambda r: r["ratio"])
    ok = worst["ratio"] <= max_ratio
    print(
        f"{'PASS' if ok else 'FAIL'}  chat engine: every call's TTFT x full <= {max_ratio}: "
        f"worst x{worst['ratio']:.3f} (conversation {worst['conversation']} turn {worst['turn']} "
        f"{worst['kind']}), {len(rows)} calls",
        flush=True,
    )
    return ok


def add_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """The chat check's options (``prefix`` names them inside another harness's parser)."""
    ap.add_argument(f"--{prefix}conversations", type=int, default=2)
    ap.add_argument(f"--{prefix}turns", type=int, default=3)
    ap.add_argument(f"--{prefix}max-ratio", type=float, default=1.05, help="most TTFT x full of any call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="MuSiQue-style JSON (default: ../shared/data/musique_dev.json)")
    ap.add_argument("--skip", type=int, default=20, help="questions skipped first (held out: 20)")
    ap.add_argument("--n", type=int, default=20, help="questions whose passages form the corpus")
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", help="write every call's row here (JSON)")
    add_arguments(ap)
    args = ap.parse_args()
    if args.out and Path(args.out).is_dir():  # found before the run, not when writing after it
        ap.error(f"--out names a file (JSON); {args.out} is a directory")
    path = dataset_path(args.data)
    if path is None:
        raise SystemExit("the dev set is not there: pass --data path/to/musique_dev.json")
    items = load_dataset(path, args.skip + args.n)[args.skip :]
    if args.conversations * args.turns > len(items):
        raise SystemExit(f"{args.conversations} x {args.turns} turns need that many questions; --n is {len(items)}")
    corpus = Corpus(items, make_embedder("minilm"))
    rows = run(items, corpus, args)
    ok = check(rows, args.max_ratio)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "records": rows}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
