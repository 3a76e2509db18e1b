"""Agentic RAG: a LangChain agent whose retriever is a tool, on the reused KV.

LangChain's ``create_agent`` with one model (``KVCachedLLM``) and two tools: ``search`` (the
retriever as a tool, ``create_retriever_tool`` over a ``KVCachedRetriever``: the documents it
returns are recorded, so the engine finds them inside the tool message and reuses their KV) and
``answer`` (ends the run). Each model call's prompt is the previous one plus the call and the tool's
answer, so each step reuses the previous step's KV too. Printed per model call: its TTFT and the prompt
tokens read from the cache, for ``KVCachedLLM()`` (kvrag) and ``KVCachedLLM(mode="full")`` (kvrag off).

A model calls tools only if its chat template renders them: the bundled SmolLM2's does not, so pass a
GGUF whose template does (Qwen2.5, Qwen2.5-Coder, Llama 3.x; ``docs/tools.md``). Everything runs offline.

    python examples/agentic_rag.py --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    python examples/agentic_rag.py --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --data handbook --warm

The first call is made to search and the call after ``--max-searches`` searches to answer (a middleware);
in between the model picks a tool (``tool_choice="any"``): left free (``"auto"``), a 0.5B model often
writes its call as bare JSON, which is no tool call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# _rag_data beside this file, whatever the working directory
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rag_data import build_index, dataset_path, load_passages  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

SYSTEM = (
    "You answer questions from a corpus of passages. Search the corpus with the search tool first; "
    "you may search again with another query. Then call the answer tool with the answer in a few words."
)
NO_TOOLS = (
    "This example needs a model whose chat template renders tools (Qwen2.5, Qwen2.5-Coder, Llama 3.x: "
    "see docs/tools.md); {what}. Pass one with --model PATH.gguf, e.g. "
    "--model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf."
)


class answer(BaseModel):  # noqa: N801 - the tool's name as the model sees it
    """Give the final answer to the question."""

    text: str = Field(description="the answer, a few words")


def tool_choice(messages: list, max_searches: int) -> str:
    """The agent's tool policy: search first, answer after ``max_searches`` searches, else the model's pick."""
    searches = sum(m.type == "tool" for m in messages)
    return "search" if searches == 0 else "answer" if searches >= max_searches else "any"


def make_agent(llm, retriever, max_searches: int = 2):
    """``create_agent`` over ``llm`` with ``search`` (the retriever as a tool) and ``answer`` (ends the run)."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.tools import StructuredTool, create_retriever_tool

    search = create_retriever_tool(retriever, "search", "Search the corpus; returns the passages most relevant.")
    final = StructuredTool.from_function(
        lambda text: text, name="answer", description=answer.__doc__, args_schema=answer, return_direct=True
    )

    @wrap_model_call
    def policy(request, handler):
        return handler(request.override(tool_choice=tool_choice(request.messages, max_searches)))

    return create_agent(model=llm, tools=[search, final], system_prompt=SYSTEM, middleware=[policy])


def final_answer(messages: list) -> str:
    """The run's answer: the ``answer`` tool's argument, else the last model message's text."""
    for m in reversed(messages):
        if m.type == "ai":
            for call in m.tool_calls:
                if call["name"] == "answer":
                    return str(call["args"].get("text", ""))
            if m.content:
                return str(m.content)
    return ""


def call_line(step: int, msg) -> str:
    """One model call: TTFT, prompt tokens from the cache, what it called."""
    meta = msg.response_metadata
    cached = msg.usage_metadata["input_token_details"]["cache_read"]
    calls = ", ".join(f"{c['name']}({', '.join(f'{v!r}' for v in c['args'].values())})" for c in msg.tool_calls)
    return (
        f"    call {step + 1}: TTFT {meta['ttft_s']:6.3f} s | {cached:5d}/{meta['prompt_tokens']:5d} prompt tokens "
        f"from cache | {calls or repr(msg.content[:60])}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF whose chat template renders tools (e.g. Qwen2.5-Coder-0.5B-Instruct)")
    ap.add_argument("--data", help="MuSiQue-style JSON, or 'handbook' (default: the shared dev set if present)")
    ap.add_argument("--questions", type=int, default=1, help="questions to ask (the first ones)")
    ap.add_argument("--k", type=int, default=3, help="passages per search")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-searches", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="compute every passage's KV ahead (the corpus loaded)")
    args = ap.parse_args()
    if args.model is None:
        print(NO_TOOLS.format(what="the bundled SmolLM2's renders none"))
        return 0

    from kvrag.integrations.langchain import KVCachedLLM, KVCachedRetriever, register_documents

    llm = KVCachedLLM(model=args.model, max_tokens=args.max_tokens, temperature=0)
    engine = llm.get_engine()
    if not llm.profile["tool_calling"]:
        print(NO_TOOLS.format(what=f"{engine.model_name}'s renders none"))
        return 0
    path = dataset_path(args.data)
    docs, questions = load_passages(path)
    print(f"{engine.model_name} ({engine.config.dtype}); {len(docs)} passages from {path or 'the handbook'}")
    store = build_index(docs)
    if args.warm:
        register_documents(docs, llm, warm=True)
        print(f"warmed {len(docs)} passages")
    retriever = KVCachedRetriever(retriever=store.as_retriever(search_kwargs={"k": args.k}), llm=llm)
    llms = {"kvrag": llm, "full prefill": KVCachedLLM(engine=engine, max_tokens=args.max_tokens, mode="full")}
    for n, question in enumerate(questions[: args.questions], 1):
        print(f"\nQ{n}: {question}")
        for name, model in llms.items():
            agent = make_agent(model, retriever, args.max_searches)
            config = {"configurable": {"thread_id": f"{name}-{n}"}, "recursion_limit": 4 * args.max_searches + 6}
            messages = agent.invoke({"messages": [("user", question)]}, config=config)["messages"]
            print(f"  {name}")
            for step, msg in enumerate(m for m in messages if m.type == "ai"):
                print(call_line(step, msg))
            print(f"    answer: {final_answer(messages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
