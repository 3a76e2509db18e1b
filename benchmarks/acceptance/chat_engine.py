"""Acceptance of a LlamaIndex ``condense_plus_context`` chat engine (issue 34): no call slower than full.

A chat engine over ``KVCachedLLM(conversation_id=...)`` makes two calls a turn from the second
turn on: it condenses the question with the history (a side call: it does not continue the
conversation) and answers it over the retrieved passages with the history (the conversation's next
turn, docs-first: the passages change, the history follows them). Each turn runs three times: in
the same chat engine over ``KVCachedLLM(mode="full")`` (its own conversation id), then in the kvrag
chat engine, then in a second ``mode="full"`` chat engine (the same calls again: the reference is
deterministic and reads no cache). Every call's TTFT is compared with the mean of the same call's two
full-prefill TTFTs around it, so a slow or fast stretch of the machine weighs on both sides; the two
references' difference is that call's *noise* (on a 2-core VM a full prefill of the same prompt
varies by up to ~15% from one run to the next). Write-back is flushed after every run of a turn.

Passages: those of the dev questions ``--skip`` .. ``--skip + --n`` (held out: ``--skip 20``) in a
faiss index of bundled-MiniLM vectors; conversation ``c`` asks questions ``c * turns`` ... in order.
Check: every call's TTFT x full <= ``--max-ratio`` (1.05), or above it by no more than the call's
noise (its two references' difference over their mean), and the median over the calls whose kvrag
path was ``full`` (nothing to reuse: the "costs nothing when it cannot help" promise) <= the same
bound: no systematic cost hides in the noise. Prints each call and the strict worst beside; exits 1
if the check fails. Timings mean something only on a quiet machine.

    python -m benchmarks.acceptance.chat_engine [--data PATH] [--skip 20] [--n 20]
        [--conversations 2] [--turns 3] [--top-k 6] [--max-tokens 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from _rag_data import dataset_path  # noqa: E402

from benchmarks.acceptance import parse_checked  # noqa: E402
from benchmarks.corpus import Corpus, make_embedder  # noqa: E402
from benchmarks.data import load_dataset  # noqa: E402

#: The two ``mode="full"`` chat engines: the same calls, timed before and after the kvrag one.
REFERENCES = ("full", "full-after")
#: The chat engines of a turn, in the order they run: the kvrag one between its two references.
ORDER = (REFERENCES[0], "kvrag", REFERENCES[1])

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
        which: KVCachedLLM(max_new_tokens=max_tokens, mode="full", conversation_id=f"{conversation}-{which}")
        for which in REFERENCES
    }
    llms["kvrag"] = KVCachedLLM(max_new_tokens=max_tokens, conversation_id=conversation)
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
            for which in ORDER:
                with record_stats() as got:
                    engines[which].chat(question)
                calls[which] = got
                engine.flush()  # a turn's write-back off the clock, before the next run of it is timed
            counts = {which: len(got) for which, got in calls.items()}
            if len(set(counts.values())) != 1:
                raise RuntimeError(f"turn {turn}: the chat engines made different numbers of calls: {counts}")
            for i, (before, mine, after) in enumerate(zip(*(calls[which] for which in ORDER))):
                if not before["prompt_tokens"] == after["prompt_tokens"] == mine["prompt_tokens"]:
                    log_mismatch(c, turn, i, before, mine, after)
                row = {
                    "conversation": c,
                    "turn": turn,
                    "call": i,
                    "kind": "answer" if i == len(calls["kvrag"]) - 1 else "condense",
                }
                row.update({f: mine.get(f) for f in FIELDS})
                row.update(paired(mine["ttft_s"], before["ttft_s"], after["ttft_s"]))
                row["full_prompt_tokens"] = before["prompt_tokens"]
                rows.append(row)
                print(
                    f"conversation {c} turn {turn} {row['kind']:8s}: {row['prompt_tokens']:5d} tokens, "
                    f"TTFT {row['ttft_s']:.3f} s against {row['full_ttfts'][0]:.3f} / {row['full_ttfts'][1]:.3f} s "
                    f"full (x{row['ratio']:.2f}, noise {row['noise']:.2f}); "
                    f"path {row['path']} ({row['path_reason']}), cache read {row['cache_read']} "
                    f"({row['conversation_tokens']} from the conversation)",
                    flush=True,
                )
    return rows


def paired(ttft: float, before: float, after: float) -> dict:
    """A call's TTFT against its two references: their mean, the ratio to it, and their noise."""
    mean = (before + after) / 2
    return {"ttft_s": ttft, "full_ttfts": [before, after], "full_ttft_s": mean, "ratio": ttft / mean,
            "noise": abs(after - before) / mean}  # fmt: skip


def log_mismatch(c: int, turn: int, call: int, before: dict, mine: dict, after: dict) -> None:
    """The three runs of a call built prompts of different lengths (printed: the pairing is then loose)."""
    print(
        f"  note: conversation {c} turn {turn} call {call}: prompts of {before['prompt_tokens']} / "
        f"{mine['prompt_tokens']} / {after['prompt_tokens']} tokens (full / kvrag / full)",
        flush=True,
    )


def verdict(rows: list[dict], max_ratio: float) -> tuple[bool, dict]:
    """Whether the calls meet the check (see the module's doc), and its figures."""
    worst = max(rows, key=lambda r: r["ratio"])
    over = [r for r in rows if r["ratio"] > max_ratio + r["noise"]]
    on_full = [r["ratio"] for r in rows if r["path"] == "full"]
    median_full = statistics.median(on_full) if on_full else None
    ok = not over and (median_full is None or median_full <= max_ratio)
    figures = {"worst": worst, "over": over, "median_full": median_full, "on_full": len(on_full)}
    return ok, figures


def check(rows: list[dict], max_ratio: float) -> bool:
    """Print the verdict: every call within ``max_ratio`` of the same call under ``mode="full"`` (or
    within that call's noise past it), and no systematic cost on the calls that reuse nothing."""
    ok, f = verdict(rows, max_ratio)
    worst = f["worst"]
    where = f"conversation {worst['conversation']} turn {worst['turn']} {worst['kind']}"
    median = "none" if f["median_full"] is None else f"x{f['median_full']:.3f}"
    print(
        f"{'PASS' if ok else 'FAIL'}  chat engine: every call's TTFT x full <= {max_ratio} or within its noise "
        f"past it: {len(f['over'])} of {len(rows)} calls over; strict worst x{worst['ratio']:.3f} ({where}, "
        f"noise {worst['noise']:.3f}); median over the {f['on_full']} calls on the full path {median} "
        f"(<= {max_ratio})",
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
    args, path = parse_checked(ap, dataset_path)
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
