"""``python -m benchmarks agentic``: agentic RAG with LangChain's ``create_agent``, kvrag against a full prefill.

    python -m benchmarks agentic --model /path/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --dataset ../shared/data/musique_dev.json --n 20 --threads 2 --out agentic.jsonl

Per dev question: a retriever tool (``create_retriever_tool`` over a :class:`KVCachedRetriever`: MiniLM
embeddings over the question's own passages, ``--k`` per search) and an ``answer`` tool that ends the run
(``return_direct``). The passages are registered and warmed first (``register_documents(..., warm=True)``),
as a deployment loads its corpus ahead. The agent runs twice, on one engine: with ``KVCachedLLM()``
(kvrag, default blend) and with ``KVCachedLLM(mode="full")``, each run its own ``thread_id``.

Tool policy (a middleware): the first model call is forced to call ``search``, the call after
``--max-searches`` searches to call ``answer``, the calls between to call one of the two
(``tool_choice="any"``). The tools stay rendered in every prompt, so each step's prompt extends the previous
one. Left to choose (``"auto"``), Qwen2.5-Coder-0.5B writes its calls as bare JSON, without the
``<tool_call>`` marks of its template, which is no tool call.

Rows (JSON lines, written as they come): one per model call (``kind="call"``: run, step, ttft_s,
cache_read, exact_tokens, prompt_tokens, tool calls), one per run (``kind="run"``: answer, F1 against gold,
whether it searched), and a last ``kind="summary"`` row: of the runs with more than one call, those whose
every call after the first reused KV (``cache_read > 0``); summed TTFT of the calls after the first (kvrag,
full, the ratio); mean F1 of both; runs that called ``search``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pydantic import BaseModel, Field

from benchmarks.data import load_dataset
from benchmarks.metrics import best_f1
from benchmarks.real_models import resolve_model

__all__ = ["main", "run", "summarize", "make_agent", "SYSTEM"]

SYSTEM = (
    "You answer questions from a corpus of passages. Search the corpus with the search tool first; "
    "you may search again with another query. Then call the answer tool with the answer in a few words."
)


class answer(BaseModel):  # noqa: N801 - the tool's name as the model sees it
    """Give the final answer to the question."""

    text: str = Field(description="the answer, a few words")


def make_agent(llm: Any, retriever: Any, max_searches: int = 2) -> Any:
    """A LangChain agent: ``search`` (the retriever as a tool, at most ``max_searches`` times) then
    ``answer`` (ends the run)."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.tools import StructuredTool, create_retriever_tool

    search = create_retriever_tool(
        retriever, "search", "Search the corpus; returns the passages most relevant to the query."
    )
    final = StructuredTool.from_function(
        lambda text: text, name="answer", description=answer.__doc__, args_schema=answer, return_direct=True
    )

    @wrap_model_call
    def search_first(request, handler):
        searches = sum(m.type == "tool" for m in request.messages)
        choice = "search" if searches == 0 else "answer" if searches >= max_searches else "any"
        return handler(request.override(tool_choice=choice))

    return create_agent(model=llm, tools=[search, final], system_prompt=SYSTEM, middleware=[search_first])


def _embeddings():
    from langchain_core.embeddings import Embeddings

    from kvrag.integrations.minilm import load_minilm

    class MiniLM(Embeddings):
        def __init__(self) -> None:
            self.model = load_minilm()

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return self.model.encode(texts, normalize_embeddings=True).tolist()

        def embed_query(self, text: str) -> list[float]:
            return self.embed_documents([text])[0]

    return MiniLM()


def _calls(messages: list, mode: str, index: int) -> list[dict]:
    rows = []
    for step, m in enumerate(m for m in messages if m.type == "ai"):
        meta = m.response_metadata
        rows.append(
            {
                "kind": "call",
                "question": index,
                "mode": mode,
                "step": step,
                "ttft_s": meta["ttft_s"],
                "cache_read": m.usage_metadata["input_token_details"]["cache_read"],
                "prompt_tokens": meta["prompt_tokens"],
                "exact_tokens": meta["exact_tokens"],  # of cache_read: the exact prefix (the previous step's prompt)
                "tool_calls": [{"name": c["name"], "args": c["args"]} for c in m.tool_calls],
                "content": m.content,
            }
        )
    return rows


def _final(messages: list) -> str:
    """The run's answer: the ``answer`` tool's argument, else the last model message's text."""
    for m in reversed(messages):
        if m.type == "ai":
            for c in m.tool_calls:
                if c["name"] == "answer":
                    return str(c["args"].get("text", ""))
            if m.content:
                return str(m.content)
    return ""


def summarize(rows: list[dict]) -> dict:
    """The summary of the call and run rows (see the module's docstring)."""
    out: dict[str, Any] = {}
    for mode in ("kvrag", "full"):
        calls = [r for r in rows if r["kind"] == "call" and r["mode"] == mode]
        runs = [r for r in rows if r["kind"] == "run" and r["mode"] == mode]
        later = [c for c in calls if c["step"] > 0]
        per_run = [[c["cache_read"] > 0 for c in later if c["question"] == r["question"]] for r in runs]
        out[mode] = {
            "runs": len(runs),
            "calls": len(calls),
            "runs_with_later_calls": sum(bool(reads) for reads in per_run),
            # of those, the runs whose every call after the first read KV from the cache
            "runs_all_later_calls_reuse": sum(bool(reads) and all(reads) for reads in per_run),
            "later_calls": len(later),
            "later_calls_reusing": sum(c["cache_read"] > 0 for c in later),
            "later_ttft_s": sum(c["ttft_s"] for c in later),
            "first_ttft_s": sum(c["ttft_s"] for c in calls if c["step"] == 0),
            "f1_mean": sum(r["f1"] for r in runs) / len(runs) if runs else 0.0,
            "runs_searched": sum(r["searched"] for r in runs),
        }
    full = out["full"]["later_ttft_s"]
    out["later_ttft_ratio"] = out["kvrag"]["later_ttft_s"] / full if full else None
    return out


def run(a: argparse.Namespace, emit=print) -> list[dict]:
    """Run the benchmark; ``emit(row)`` for each row as it comes; returns the rows."""
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    from kvrag.integrations.langchain import KVCachedLLM, KVCachedRetriever, register_documents

    settings = {"max_tokens": a.max_tokens, "temperature": 0}
    llm = KVCachedLLM(
        model=resolve_model(a.model), engine_config={"num_threads": a.threads} if a.threads else {}, **settings
    )
    engine = llm.get_engine()
    llms = {"kvrag": llm, "full": KVCachedLLM(engine=engine, mode="full", **settings)}
    embeddings = _embeddings()
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        emit(row)

    add({"kind": "settings", **vars(a), "model_name": engine.model_name, "dtype": engine.config.dtype})
    for item in load_dataset(a.dataset, a.n):
        docs = [Document(page_content=p.strip()) for p in item.passages]
        t0 = time.perf_counter()
        # the corpus loaded ahead, as a deployment does (in the given order: one variant, half of
        # register_documents(warm=True)'s cost, which this 2-core machine cannot spare per question)
        register_documents(docs, llm)
        engine.warm([d.page_content for d in docs])
        warm_s = time.perf_counter() - t0
        store = InMemoryVectorStore.from_documents(docs, embeddings)
        for mode, model in llms.items():
            retriever = KVCachedRetriever(retriever=store.as_retriever(search_kwargs={"k": a.k}), llm=llm)
            agent = make_agent(model, retriever, a.max_searches)
            config = {"configurable": {"thread_id": f"{mode}-{item.index}"}, "recursion_limit": 4 * a.max_searches + 6}
            t1 = time.perf_counter()
            try:
                messages = agent.invoke({"messages": [("user", item.question)]}, config=config)["messages"]
                error = None
            except Exception as e:  # noqa: BLE001 - a run past its step limit is a finding, recorded
                messages, error = [], f"{type(e).__name__}: {e}"
            for row in _calls(messages, mode, item.index):
                add(row)
            prediction = _final(messages)
            add(
                {
                    "kind": "run",
                    "question": item.index,
                    "mode": mode,
                    "answer": prediction,
                    "gold": item.answers,
                    "f1": best_f1(prediction, item.answers),
                    "searched": any(m.type == "tool" and m.name == "search" for m in messages),
                    "run_s": time.perf_counter() - t1,
                    "warm_s": warm_s,
                    "error": error,
                }
            )
    add({"kind": "summary", **summarize(rows)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks agentic", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a .gguf path (a tool-capable chat template) or a real model's name")
    p.add_argument("--dataset", required=True, help="a QA JSON file (question, answers, ctxs)")
    p.add_argument("--n", type=int, default=20, help="questions (the first n)")
    p.add_argument("--k", type=int, default=3, help="passages per search")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens per model call")
    p.add_argument("--max-searches", type=int, default=2, help="most searches per run (then answer is forced)")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: torch's)")
    p.add_argument("--out", default=None, help="append the rows here (JSON lines) as they come")
    a = p.parse_args(argv)
    out = open(a.out, "a", encoding="utf-8") if a.out else None  # noqa: SIM115 - closed below

    def emit(row: dict) -> None:
        if out is not None:
            out.write(json.dumps(row) + "\n")
            out.flush()
        if row["kind"] == "call":
            print(
                f"q{row['question']} {row['mode']:5s} step {row['step']}: ttft {row['ttft_s']:.2f}s "
                f"cache_read {row['cache_read']}/{row['prompt_tokens']}",
                file=sys.stderr,
                flush=True,
            )

    try:
        rows = run(a, emit)
    finally:
        if out is not None:
            out.close()
    print(json.dumps(rows[-1], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
