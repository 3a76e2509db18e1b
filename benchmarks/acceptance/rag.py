"""Acceptance of the integrations on workload (r), write-back (issue 17): judged over many requests.

The request stream of ``python -m benchmarks``'s workload (r) (:mod:`benchmarks.corpus`: the first ``--n``
dev questions' passages pooled in a faiss index of bundled-MiniLM vectors; the questions asked in
sequence, each coming back later reworded, with Zipf popularity) goes through three flows:

- ``lcel``: an LCEL stuff chain (retriever | format_docs -> prompt -> chat model);
- ``classic``: ``create_retrieval_chain`` over ``create_stuff_documents_chain`` (langchain-classic);
- ``llamaindex``: a LlamaIndex query engine (faiss vector store, kvrag's node postprocessor).

Each flow answers every request twice: with ``KVCachedLLM()`` (default settings) and with the same
chain over ``KVCachedLLM(mode="full")``, the reference (a full prefill stores nothing, so it never
helps the other). Each flow starts cold, the store emptied: chunk KV comes only from the requests'
own write-back. Checks per flow, over the requests with at least ``--min-hits`` chunk hits (at
least ``--min-requests`` of them): mean ROUGE-L against the full chain's answer >= 0.85, and the
median of TTFT x full minus the share of prompt tokens not found in the store <= 0.25 (new passages
are computed in full; that part is not the engine's to save). Over every request, grouped by the
chunks whose KV the store held (issue 34: never slower than a full prefill when the cache cannot
help): median TTFT x full <= 1.03 with none found, <= 1.0 with 1-3 found (the path each request took
is in its row). ``--chat`` also runs a LlamaIndex ``condense_plus_context`` chat engine, every call
against the same call under ``mode="full"`` run before and after it
(:mod:`benchmarks.acceptance.chat_engine`). Prints the figures and a PASS/FAIL line per check; exits 1
if one fails. Timings mean something only on a quiet machine.

    python -m benchmarks.acceptance.rag [--data PATH] [--n 20] [--skip 0] [--requests 40]
        [--flows lcel,classic,llamaindex] [--top-k 6] [--max-tokens 32] [--zipf 1.0] [--seed 0]
        [--chat [--chat-conversations 2] [--chat-turns 3]] [--out results.json]

The issue-34 run (held-out passages, the LCEL app and the chat engine, one command):

    python -m benchmarks.acceptance.rag --skip 20 --flows lcel --chat
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from _rag_data import MiniLMEmbeddings, dataset_path, format_docs  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda, RunnablePassthrough  # noqa: E402

from benchmarks.acceptance import chat_engine, parse_checked  # noqa: E402
from benchmarks.corpus import Corpus, make_embedder, question_stream  # noqa: E402
from benchmarks.data import load_dataset  # noqa: E402
from benchmarks.metrics import rouge_l, summarize  # noqa: E402
from benchmarks.report_retrieval import retrieval_figures, retrieval_table  # noqa: E402

SYSTEM = "Answer the question from the context, in one short sentence.\n\n{context}"
FLOWS = ("lcel", "classic", "llamaindex")
RESULTS: list[tuple[str, bool, str]] = []
#: Requests grouped by the chunks whose KV the store held: (name, fewest, most, most median TTFT x full).
FOUND_GROUPS = (("0 found", 0, 0, 1.03), ("1-3 found", 1, 3, 1.0), (">= 4 found", 4, None, None))
#: (which LLM: "kvrag" or "full", question) -> (answer, the call's kvrag figures)
Ask = Callable[[str, str], tuple[str, dict]]


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


# -- the flows: each builds its chain twice, over KVCachedLLM() and KVCachedLLM(mode="full") ------------


def lcel_chain(retriever, llm):
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm


def classic_chain(retriever, llm):
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{input}")])
    # keep the AI message (the documents chain parses it to a string by default): it has the figures
    inner = create_stuff_documents_chain(llm, prompt, output_parser=RunnableLambda(lambda m: m))
    return {"input": RunnablePassthrough()} | create_retrieval_chain(retriever, inner)


def langchain_flow(make_chain, answer_of, corpus: Corpus, k: int, max_tokens: int) -> tuple[Ask, object]:
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy

    from kvrag.integrations.langchain import KVCachedLLM, KVCachedRetriever

    texts = [p.strip() for p in corpus.passages]
    store = FAISS.from_embeddings(  # the corpus's own MiniLM vectors; queries embedded by the same model
        list(zip(texts, corpus.vectors.tolist())),
        MiniLMEmbeddings(),
        distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT,
    )
    llms = {"kvrag": KVCachedLLM(max_tokens=max_tokens), "full": KVCachedLLM(max_tokens=max_tokens, mode="full")}
    retriever = KVCachedRetriever(retriever=store.as_retriever(search_kwargs={"k": k}), llm=llms["kvrag"])
    chains = {which: make_chain(retriever, llm) for which, llm in llms.items()}

    def ask(which: str, question: str) -> tuple[str, dict]:
        msg = answer_of(chains[which].invoke(question))
        return msg.content, dict(msg.response_metadata)

    return ask, llms["kvrag"].get_engine()


def llamaindex_flow(corpus: Corpus, k: int, max_tokens: int) -> tuple[Ask, object]:
    import faiss
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.vector_stores.faiss import FaissVectorStore

    from kvrag.integrations.llama_index import KVCachedLLM, minilm_embedding, record_stats

    nodes = [
        TextNode(text=p.strip(), id_=f"p{i}", embedding=corpus.vectors[i].tolist())
        for i, p in enumerate(corpus.passages)
    ]
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(corpus.vectors.shape[1]))
    index = VectorStoreIndex(  # the nodes carry the corpus's vectors: only queries are embedded here
        nodes, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=minilm_embedding()
    )
    llms = {
        "kvrag": KVCachedLLM(max_new_tokens=max_tokens),
        "full": KVCachedLLM(max_new_tokens=max_tokens, mode="full"),
    }
    post = llms["kvrag"].node_postprocessor()
    engines = {
        which: index.as_query_engine(llm=llm, similarity_top_k=k, node_postprocessors=[post])
        for which, llm in llms.items()
    }

    def ask(which: str, question: str) -> tuple[str, dict]:
        with record_stats() as calls:
            text = str(engines[which].query(question)).strip()
        if len(calls) != 1:
            raise RuntimeError(f"expected one LLM call per query, got {len(calls)} (the prompt did not fit one)")
        return text, dict(calls[0])

    return ask, llms["kvrag"].engine


# -- one flow over the stream ----------------------------------------------------------------------------


def record(ask, text: str, meta: dict, full_text: str, full_meta: dict, min_hits: int) -> dict:
    """One request's row, with the bench's field names (benchmarks.report_retrieval reads them)."""
    ratio = meta["ttft_s"] / full_meta["ttft_s"]
    uncached = 1.0 - meta["cache_read"] / meta["prompt_tokens"]
    return {
        "request": ask.position,
        "question_index": ask.question,
        "occurrence": ask.occurrence,
        "question": ask.text,
        "text": text,
        "full_text": full_text,
        "ttft_s": meta["ttft_s"],
        "full_ttft_s": full_meta["ttft_s"],
        "ttft_ratio_full": ratio,
        "prompt_tokens": meta["prompt_tokens"],
        "prompt_tokens_match_full": meta["prompt_tokens"] == full_meta["prompt_tokens"],
        "cached_tokens": meta["cache_read"],
        "prefix_tokens": meta["prefix_tokens"],
        "exact_tokens": meta["exact_tokens"],
        "recomputed_tokens": meta["recomputed_tokens"],
        "recompute_fraction": meta["recompute_ratio"] if meta["chunk_hits"] else None,  # asked or, auto, measured
        "uncached_share": uncached,
        "ttft_excess_full": ratio - uncached,
        "chunk_hits": meta["chunk_hits"],
        "chunks_found": meta["chunks_found"],
        "path": meta["path"],
        "path_reason": meta["path_reason"],
        "chunks": meta["chunk_hits"] + meta["chunk_misses"],
        "many_hits": meta["chunk_hits"] >= min_hits,
        "rouge_l_full": rouge_l(text, full_text),
        "identical_full": text == full_text,
    }


def run_flow(name: str, ask: Ask, engine, asks, args) -> list[dict]:
    from tqdm.auto import tqdm

    engine.flush()
    engine.store.clear()  # a cold start: chunk KV comes only from this flow's own requests
    rows: list[dict] = []
    bar = tqdm(asks, desc=name, dynamic_ncols=True)
    for a in bar:
        text, meta = ask("kvrag", a.text)
        engine.flush()  # write-back off the clock, before the reference is timed
        full_text, full_meta = ask("full", a.text)
        rows.append(dict(record(a, text, meta, full_text, full_meta, args.min_hits), flow=name))
        many = [r for r in rows if r["many_hits"]]
        rouge = summarize(r["rouge_l_full"] for r in many)["mean"] or 0.0
        excess = summarize(r["ttft_excess_full"] for r in many)["median"] or 0.0
        bar.set_postfix_str(f"{len(many)} with >= {args.min_hits} hits: ROUGE-L {rouge:.3f}, excess {excess:.3f}")
    return rows


def report(name: str, rows: list[dict], args) -> dict:
    figures = {"all": retrieval_figures(rows), "many_hits": retrieval_figures([r for r in rows if r["many_hits"]])}
    print(f"\n[{name}]")
    print(retrieval_table({name: figures}, "all") + "\n")
    print(retrieval_table({name: figures}, "many_hits", args.min_hits, args.top_k) + "\n")
    many = figures["many_hits"]
    check(
        f"{name}: requests with >= {args.min_hits} chunk hits",
        many["n"] >= args.min_requests,
        f"{many['n']} of {len(rows)} (need >= {args.min_requests})",
    )
    if many["n"]:
        check(
            f"{name}: mean ROUGE-L vs mode=full",
            many["rouge_l_full"] >= 0.85,
            f"{many['rouge_l_full']:.3f} (need >= 0.85; identical {many['identical_full']}/{many['identical_of']})",
        )
        excess = many["ttft_excess_full"]["median"]
        check(
            f"{name}: median TTFT x full - share not in store",
            excess <= 0.25,
            f"{excess:.3f} (need <= 0.25; TTFT x full median {many['ttft_ratio_full']['median']:.3f}, "
            f"not in store {many['uncached_share']:.1%} on average)",
        )
    figures["found"] = found_groups(name, rows)
    return figures


def found_groups(name: str, rows: list[dict]) -> dict:
    """Median TTFT x full of the requests by chunks found in the store, each group's check, the paths taken."""
    out = {}
    for group, lo, hi, limit in FOUND_GROUPS:
        sel = [r for r in rows if r["chunks_found"] >= lo and (hi is None or r["chunks_found"] <= hi)]
        ratios = summarize(r["ttft_ratio_full"] for r in sel)
        paths = {p: sum(r["path"] == p for r in sel) for p in sorted({r["path"] for r in sel})}
        out[group] = {"n": len(sel), "ttft_ratio_full": ratios, "paths": paths}
        median = ratios["median"]
        text = f"{len(sel)} requests" + (
            f", median TTFT x full {median:.3f} (p10 {ratios['p10']:.3f}, p90 {ratios['p90']:.3f}), paths {paths}"
            if sel
            else ""
        )
        if limit is None or not sel:
            print(f"      {name}: {group}: {text}", flush=True)
        else:
            check(f"{name}: {group}: median TTFT x full <= {limit}", median <= limit, text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="MuSiQue-style JSON (default: ../shared/data/musique_dev.json)")
    ap.add_argument("--n", type=int, default=20, help="questions whose passages form the corpus")
    ap.add_argument("--skip", type=int, default=0, help="questions skipped first (held-out runs: --skip 20)")
    ap.add_argument("--requests", type=int, default=40, help="stream length (first asks + returns)")
    ap.add_argument("--flows", default=",".join(FLOWS), help=f"comma-separated, of {', '.join(FLOWS)}")
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of question popularity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-hits", type=int, default=4, help="chunk hits of the requests the checks are over")
    ap.add_argument("--min-requests", type=int, default=10, help="fewest such requests for a verdict")
    ap.add_argument("--chat", action="store_true", help="also run the condense_plus_context chat engine check")
    chat_engine.add_arguments(ap, "chat-")
    ap.add_argument("--out", help="write every request's row and the figures here (JSON)")
    args, path = parse_checked(ap, dataset_path)
    flows = [f.strip() for f in args.flows.split(",") if f.strip()]
    if not flows or set(flows) - set(FLOWS):
        raise SystemExit(f"--flows takes {', '.join(FLOWS)}, got {args.flows!r}")
    if args.skip < 0:
        raise SystemExit("--skip must be >= 0")
    items = load_dataset(path, args.skip + args.n)[args.skip :]
    asks = question_stream(items, args.requests, args.zipf, args.seed)
    print(
        f"{len(asks)} requests over {len(items)} questions (from {args.skip}); embedding their passages with MiniLM...",
        flush=True,
    )
    corpus = Corpus(items, make_embedder("minilm"))
    print(f"{len(corpus.passages)} passages pooled", flush=True)
    builders = {
        "lcel": lambda: langchain_flow(lcel_chain, lambda r: r, corpus, args.top_k, args.max_tokens),
        "classic": lambda: langchain_flow(classic_chain, lambda r: r["answer"], corpus, args.top_k, args.max_tokens),
        "llamaindex": lambda: llamaindex_flow(corpus, args.top_k, args.max_tokens),
    }
    rows, figures = [], {}
    for name in flows:
        ask, engine = builders[name]()
        ask("full", "Say hello.")  # load and warm the engine up; not part of any figure
        flow_rows = run_flow(name, ask, engine, asks, args)
        figures[name] = report(name, flow_rows, args)
        rows += flow_rows
    chat_rows = []
    if args.chat:
        chat_args = argparse.Namespace(
            conversations=args.chat_conversations, turns=args.chat_turns, top_k=args.top_k, max_tokens=args.max_tokens
        )
        chat_rows = chat_engine.run(items, corpus, chat_args)
        RESULTS.append(("chat engine", chat_engine.check(chat_rows, args.chat_max_ratio), ""))
    if args.out:
        out = {"args": vars(args), "figures": figures, "records": rows, "chat": chat_rows}
        Path(args.out).write_text(json.dumps(out, indent=1))
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
