"""A multi-turn RAG chat: the conversation's KV is kept between turns.

Each turn retrieves documents and answers with the chat history; the run config's
``configurable.session_id`` (as ``RunnableWithMessageHistory`` sets it; LangGraph's ``thread_id``
works too) is what kvrag uses as the conversation id. Two prompt layouts:

* ``docs-first`` (default; LangChain's usual chat-RAG prompt): the system message carries this
  turn's documents, the history follows. kvrag reuses the history's KV from the previous turn at
  its shifted position (blended like a document) and the documents' KV from the chunk cache.
* ``append-only``: each turn's documents go into that turn's user message, which stays in the
  history. kvrag reuses the whole history as an exact prefix, and drops documents that an earlier
  turn already put in the context (conversation-scoped deduplication).

Each turn runs twice, in two sessions: kvrag off (``mode="full"``) and kvrag on.

    python examples/multi_turn_chat.py [--layout append-only] [--data path/to/musique_dev.json | handbook] [--turns N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rag_data import build_index, dataset_path, format_docs, load_passages  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder  # noqa: E402

from kvrag.integrations.langchain import KVCachedLLM, KVCachedRetriever  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer the user's questions from the context, in one or two sentences."

DOCS_FIRST = ChatPromptTemplate.from_messages(
    [("system", SYSTEM + "\n\nContext:\n{context}"), MessagesPlaceholder("history"), ("human", "{question}")]
)
APPEND_ONLY = ChatPromptTemplate.from_messages(
    [("system", SYSTEM), MessagesPlaceholder("history"), ("human", "{user_message}")]
)

HANDBOOK_TURNS = [
    "When was the Harbor Street Library opened?",
    "Who was its first librarian?",
    "Who built the lighthouse at Gull Point?",
    "How tall is the lighthouse?",
    "Is the library open on Sundays?",
]
# Dev-set questions whose retrieved passages overlap (pairs 39/40 and 45/46 share 4-5 of their top 6).
DEV_TURNS = (39, 40, 45, 46, 39)


def run_turn(layout: str, retriever, llm, history: list, question: str, config: dict):
    """One turn: retrieve, build the layout's prompt, answer; appends the turn to ``history``.

    Returns the answer message and the prompt's messages.
    """
    context = format_docs(retriever.invoke(question, config))
    if layout == "docs-first":
        prompt = DOCS_FIRST.invoke({"context": context, "history": history, "question": question})
        user = question
    else:  # the user message (documents + question) is what the history keeps
        user = f"Context:\n{context}\n\nQuestion: {question}"
        prompt = APPEND_ONLY.invoke({"history": history, "user_message": user})
    answer = llm.invoke(prompt, config)
    history += [HumanMessage(user), AIMessage(answer.content)]
    return answer, prompt.to_messages()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=("docs-first", "append-only"), default="docs-first")
    ap.add_argument(
        "--data",
        help="MuSiQue-style JSON, or 'handbook' for examples/data/handbook.json "
        "(default: ../shared/data/musique_dev.json if present, else the handbook)",
    )
    ap.add_argument("--k", type=int, default=4, help="documents retrieved per turn")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--turns", type=int, default=5, help="turns of the conversation (at most 5)")
    args = ap.parse_args()

    path = dataset_path(args.data)
    docs, questions = load_passages(path)
    turns = ([questions[i] for i in DEV_TURNS] if path else HANDBOOK_TURNS)[: args.turns]
    print(f"{len(docs)} passages; building the faiss index with MiniLM...")
    store = build_index(docs)
    kvrag_llm = KVCachedLLM(max_tokens=args.max_tokens)
    full_llm = KVCachedLLM(max_tokens=args.max_tokens, mode="full")
    retriever = KVCachedRetriever(retriever=store.as_retriever(search_kwargs={"k": args.k}), llm=kvrag_llm)
    llms = {"full prefill": full_llm, "kvrag": kvrag_llm}
    histories: dict[str, list] = {name: [] for name in llms}
    kvrag_llm.invoke("Say hello.")  # load and warm the engine
    print(f"layout: {args.layout}\n")
    for n, question in enumerate(turns, 1):
        print(f"turn {n}: {question}")
        for name, llm in llms.items():
            config = {"configurable": {"session_id": name}}  # the conversation id kvrag uses
            msg, _ = run_turn(args.layout, retriever, llm, histories[name], question, config)
            m = msg.response_metadata
            print(
                f"  {name:12s} TTFT {m['ttft_s']:6.3f} s | prompt {m['prompt_tokens']:5d} tokens, "
                f"{msg.usage_metadata['input_token_details']['cache_read']:5d} from cache "
                f"({m['conversation_tokens']} from the conversation), {m['deduplicated_chunks']} chunks deduplicated"
            )
            print(f"  {'':12s} {' '.join(msg.content.split())}")
        kvrag_llm.get_engine().flush()
    kvrag_llm.get_engine().end_conversation("kvrag")


if __name__ == "__main__":
    main()
