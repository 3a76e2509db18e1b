"""The LangChain drop-ins on the tiny random Llama: chains, registration, conversations, async, errors."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings.fake import DeterministicFakeEmbedding  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.runnables import RunnableLambda, RunnablePassthrough  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from kvrag import ContextLengthError, Engine, InvalidRequestError, SamplingParams  # noqa: E402
from kvrag.integrations.langchain import (  # noqa: E402
    KVCachedLLM,
    KVCachedRetriever,
    KVCachedTextLLM,
    KVCachedVectorStore,
    register_documents,
)
from tests.helpers import make_docs, stored_contexts  # noqa: E402

PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the documents.\n\n{context}"), ("human", "{question}")]
)


class ListRetriever(BaseRetriever):
    """Returns the documents whose index is in the query's ``order`` (a fake search)."""

    docs: list[Document]

    def _get_relevant_documents(self, query, *, run_manager):
        order = [int(x) for x in query.split(":")[0].split(",")]
        return [self.docs[i] for i in order]


def format_docs(docs):
    return "\n\n".join(d.page_content for d in docs)


@pytest.fixture
def lc_engine(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=6))
    yield engine
    engine.close()


@pytest.fixture
def documents():
    return [Document(page_content=t.strip(), metadata={"i": i}) for i, t in enumerate(make_docs(6, words=50))]


def test_lcel_stuff_chain_reuses_retrieved_chunks(lc_engine, documents):
    llm = KVCachedLLM(engine=lc_engine)
    retriever = KVCachedRetriever(retriever=ListRetriever(docs=documents), llm=llm)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm
    first = chain.invoke("0,1,2,3: where was the king born?")
    lc_engine.flush()
    second = chain.invoke("3,1,0,4: and the queen?")
    assert first.response_metadata["chunk_misses"] == 4 and first.response_metadata["chunk_hits"] == 0
    assert second.response_metadata["chunk_hits"] == 3  # 3, 1 and 0 again, in another order
    assert second.usage_metadata["input_token_details"]["cache_read"] >= 3 * 40
    assert second.response_metadata["recomputed_tokens"] > 0 and second.response_metadata["mode"] == "blend"
    assert second.response_metadata["ttft_s"] > 0
    # the second ask blended its documents; the engine then computed exactly (idle time) the leading
    # run of them that recurs (CRAFT's promotion: 3, 1 and 0 were retrieved twice, 4 once): asked
    # again in a reworded question, those are reused exactly and 4 is blended
    lc_engine.flush()
    again = chain.invoke("3,1,0,4: and what about the queen?")
    meta = again.response_metadata
    assert meta["chunk_hits"] == 4 and 0 < meta["recomputed_tokens"] and meta["exact_tokens"] >= 3 * 40
    # 4 has recurred now: the whole sequence is kept exactly, and the next ask recomputes nothing
    lc_engine.flush()
    again = chain.invoke("3,1,0,4: and what about the queen?")
    meta = again.response_metadata
    assert meta["chunk_hits"] == 4 and meta["recomputed_tokens"] == 0
    assert meta["exact_tokens"] == meta["cache_read"] > second.response_metadata["exact_tokens"]
    full = (PROMPT | KVCachedLLM(engine=lc_engine, mode="full")).invoke(
        {"context": format_docs([documents[i] for i in (3, 1, 0, 4)]), "question": "3,1,0,4: and what about the queen?"}
    )
    assert again.content == full.content


def test_vector_store_wrapper_records_search_results(lc_engine, documents):
    llm = KVCachedLLM(engine=lc_engine, mode="reuse")
    store = KVCachedVectorStore(InMemoryVectorStore(DeterministicFakeEmbedding(size=16)), llm=llm)
    store.add_documents(documents)
    found = store.similarity_search("king", k=3)
    assert len(found) == 3 and all(d.page_content in lc_engine.documents for d in found)
    scored = asyncio.run(store.asimilarity_search_with_score("queen", k=2))
    assert all(d.page_content in lc_engine.documents for d, _ in scored)
    via_retriever = store.as_retriever(search_kwargs={"k": 2}).invoke("tower")
    assert all(d.page_content in lc_engine.documents for d in via_retriever)
    with pytest.raises(NotImplementedError):
        KVCachedVectorStore.from_texts(["a"], DeterministicFakeEmbedding(size=4))


def test_register_documents_and_missing_documents_are_not_used(lc_engine, documents):
    llm = KVCachedLLM(engine=lc_engine)
    ids = register_documents(documents[:2] + ["a plain string document that is long enough to keep"], llm)
    assert len(ids) == 3
    out = llm.invoke([("system", "no documents here at all"), ("human", "hello")])
    assert out.response_metadata["chunk_hits"] == out.response_metadata["chunk_misses"] == 0
    with pytest.raises(InvalidRequestError):
        register_documents([42], llm)


@pytest.mark.parametrize(
    "config",
    [
        {"configurable": {"session_id": "s-1"}},
        {"configurable": {"thread_id": "s-1"}},
        {"metadata": {"conversation_id": "s-1"}},
    ],
)
def test_conversation_identity_from_run_config(lc_engine, config):
    llm = KVCachedLLM(engine=lc_engine)
    msgs = [("human", "where was the king born in the river city?")]
    for call in (lambda: llm.invoke(msgs, config=config), lambda: list(llm.stream(msgs, config=config))[-1]):
        lc_engine.end_conversation("s-1")
        msg = call()
        assert msg.response_metadata["conversation_id"] == "s-1"
        assert ("default", "s-1") in lc_engine.conversations
    # inside a chain the model sees the chain's config (LangChain's context variable)
    lc_engine.end_conversation("s-1")
    chain = RunnableLambda(lambda q: [("human", q)]) | llm
    last = None
    for last in chain.stream("where was the queen born?", config=config):  # noqa: B007 - the last chunk is checked
        pass
    assert last.response_metadata["conversation_id"] == "s-1"


def test_multi_turn_docs_first_reuses_history(lc_engine, documents):
    llm = KVCachedLLM(engine=lc_engine, max_tokens=12)
    register_documents(documents, llm)
    cfg = {"configurable": {"session_id": "chat"}}
    history = []
    for turn, (order, question) in enumerate([((0, 1), "where was the king born?"), ((2, 1), "and the queen?")]):
        context = format_docs([documents[i] for i in order])
        msgs = [("system", f"Answer from the documents.\n\n{context}"), *history, ("human", question)]
        answer = llm.invoke(msgs, config=cfg)
        if turn == 1:
            assert answer.response_metadata["conversation_tokens"] > 0
            assert (
                answer.usage_metadata["input_token_details"]["cache_read"]
                >= answer.response_metadata["conversation_tokens"]
            )
        history += [("human", question), ("ai", answer.content)]


async def test_async_calls_run_off_the_event_loop(lc_engine):
    llm = KVCachedLLM(engine=lc_engine, max_tokens=6)
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    msg = await llm.ainvoke("hello the river")
    pieces = [c async for c in llm.astream("hello the mountain")]
    many = await llm.abatch(["a b c", "d e f"])
    stop.set()
    await task
    assert msg.usage_metadata["output_tokens"] > 0 and pieces[-1].chunk_position == "last" and len(many) == 2
    assert ticks > 5  # the loop kept running while the engine worked


def test_stop_sequences_and_call_arguments(lc_engine):
    llm = KVCachedLLM(engine=lc_engine, max_tokens=12)
    full = llm.invoke("hello the river")
    cut_at = full.content[2:4]
    if cut_at.strip():
        stopped = llm.invoke("hello the river", stop=[cut_at])
        assert cut_at not in stopped.content and full.content.startswith(stopped.content)
    assert llm.invoke("hello the river", max_tokens=2).usage_metadata["output_tokens"] <= 2
    assert llm.invoke("hello the river", mode="full").response_metadata["mode"] == "full"
    with pytest.raises(InvalidRequestError, match="unknown selection"):  # handed to the engine per call
        llm.invoke("hello the river", selection="oracle")
    with pytest.raises(InvalidRequestError, match="quality must be one of"):  # the dial too
        llm.invoke("hello the river", quality="best")
    with pytest.raises(InvalidRequestError, match="unknown argument"):
        llm.invoke("hello", frequency_penalty=1.0)
    with pytest.raises(InvalidRequestError, match="text messages only"):
        llm.invoke([("human", [{"type": "image", "url": "http://x"}])])


def test_constructor_is_cheap_and_strict():
    llm = KVCachedLLM(max_tokens=5)  # no engine is loaded here
    assert llm.engine is None
    with pytest.raises(ValueError, match="Extra inputs"):
        KVCachedLLM(openai_api_key="x")
    with pytest.raises(ValueError, match="Extra inputs"):
        KVCachedTextLLM(top_k=3)
    with pytest.raises(ValueError, match="engine_config"):
        KVCachedLLM(engine_config={"recompute_ratio": 0.3})
    with pytest.raises(ValueError, match="engine_config"):  # per call, not a second engine
        KVCachedLLM(engine_config={"selection": "recency"})
    with pytest.raises(ValueError, match="sampling"):  # the defaults of per-call arguments
        KVCachedLLM(engine_config={"sampling": {"max_new_tokens": 3}})
    with pytest.raises(ValueError, match="max_new_tokens"):
        KVCachedLLM(engine_config={"max_new_tokens": 3})
    with pytest.raises(ValueError, match=r"selection_params=\{'probe_layer'"):  # a former field says where it went
        KVCachedLLM(engine_config={"probe_layer": 12})
    KVCachedLLM(engine_config={"selection_params": {"probe_layer": 12}})  # the probe's own: an engine setting
    with pytest.warns(DeprecationWarning, match="foreign_ratio is now other_context_ratio"):  # an old name works
        KVCachedLLM(engine_config={"foreign_ratio": 0.2})
    with pytest.raises(ValueError, match="recompute_ratio"):
        KVCachedLLM(recompute_ratio=1.5)
    with pytest.raises(ValueError, match="quality"):
        KVCachedLLM(quality="best")
    with pytest.raises(ValueError, match="engine_config"):  # per call, not a second engine
        KVCachedLLM(engine_config={"quality": "fast"})


def test_tracing_parameters_name_kvrag_and_the_model():
    """Both LLM kinds report provider and model to LangSmith, and identify by model/mode/ratio."""
    chat = KVCachedLLM(max_tokens=4, temperature=0.0, stop=["END"], recompute_ratio=0.3)
    text = KVCachedTextLLM(model="/models/other", mode="full")
    ls = chat._get_ls_params()
    assert ls["ls_provider"] == "kvrag" and ls["ls_model_type"] == "chat"
    assert ls["ls_model_name"] == "SmolLM2-135M-Instruct" and ls["ls_max_tokens"] == 4 and ls["ls_stop"] == ["END"]
    assert chat._get_ls_params(model="per-call")["ls_model_name"] == "per-call"
    assert text._get_ls_params()["ls_provider"] == "kvrag" and text._get_ls_params()["ls_model_type"] == "llm"
    assert text._get_ls_params()["ls_model_name"] == "/models/other"
    assert chat._identifying_params == {"model": "SmolLM2-135M-Instruct", "mode": None, "recompute_ratio": 0.3}
    assert text._identifying_params == {"model": "/models/other", "mode": "full", "recompute_ratio": None}
    assert chat.engine is None and text.engine is None  # none of this loads an engine


def test_field_literals_name_the_engine_choices():
    from typing import get_args

    from kvrag.config import MODES
    from kvrag.integrations.langchain._common import Mode

    assert set(get_args(Mode)) == set(MODES)


def test_a_selection_is_checked_against_the_registry_when_the_call_runs(lc_engine):
    from kvrag.engine.reuse.selection import registered_selections

    llm = KVCachedLLM(engine=lc_engine, max_tokens=2, selection="oracle")  # a string: no list to copy here
    with pytest.raises(InvalidRequestError, match="unknown selection 'oracle'; registered: ") as info:
        llm.invoke("hello the river")
    assert all(name in str(info.value) for name in registered_selections())


def test_selection_reaches_the_engine(lc_engine, monkeypatch):
    seen = []
    original = lc_engine.stream
    monkeypatch.setattr(lc_engine, "stream", lambda *a, **k: seen.append(k["selection"]) or original(*a, **k))
    llm = KVCachedLLM(engine=lc_engine, max_tokens=2, selection="probe")
    llm.invoke("hello the river")
    llm.invoke("hello the river", selection="recency")
    KVCachedTextLLM(engine=lc_engine, max_tokens=2, selection="recency").invoke("hello")
    assert seen == ["probe", "recency", "recency"]


def test_context_window_error_names_the_limit(lc_engine):
    llm = KVCachedLLM(engine=lc_engine)
    with pytest.raises(ContextLengthError, match=f"context window is {lc_engine.context_window} tokens"):
        llm.invoke("river mountain castle " * 600)


def test_text_llm(lc_engine, documents):
    llm = KVCachedTextLLM(engine=lc_engine, max_tokens=5)
    register_documents(documents[:2], llm)
    prompt = f"{documents[0].page_content}\n{documents[1].page_content}\nQuestion: who?"
    text = llm.invoke(prompt)
    assert isinstance(text, str)
    lc_engine.flush()
    res = llm.generate([prompt])
    info = res.generations[0][0].generation_info
    assert info["chunk_hits"] == 2 and info["usage_metadata"]["input_token_details"]["cache_read"] > 0
    assert res.llm_output["token_usage"]["cache_read"] > 0
    assert "".join(llm.stream(prompt)) == res.generations[0][0].text
    chat = KVCachedTextLLM(engine=lc_engine, max_tokens=3, chat_template=True)
    assert chat.generate(["hi"]).generations[0][0].generation_info["prompt_tokens"] > lc_engine.count_tokens("hi") + 1
    assert asyncio.run(llm.ainvoke(prompt)) == res.generations[0][0].text  # blended like the sync call


def test_register_documents_with_warm_computes_each_behind_its_likes(lc_engine, tiny_model, tiny_tokenizer, documents):
    texts = [d.page_content for d in documents]
    ids = register_documents(documents, KVCachedLLM(engine=lc_engine), warm=True)
    assert len(ids) == len(texts)
    got = stored_contexts(lc_engine, texts)
    with (
        Engine.from_model(tiny_model, tiny_tokenizer) as similar,
        Engine.from_model(tiny_model, tiny_tokenizer) as given,
    ):
        similar.warm(texts, order="similar")
        given.warm(texts)
        assert got == stored_contexts(similar, texts) != stored_contexts(given, texts)


def test_frequency_order_is_opt_in_and_keeps_rank_and_score(lc_engine, documents):
    """Default: the wrapped retriever's documents themselves, in its order, counted once per search.
    ``order="frequency"``: the most retrieved lately first (ties in retrieval order), copies that keep
    their rank and score; the store's own documents untouched."""
    llm = KVCachedLLM(engine=lc_engine)
    plain = KVCachedRetriever(retriever=ListRetriever(docs=documents), llm=llm)
    got = plain.invoke("4,5: first")
    assert got == [documents[4], documents[5]] and got[0] is documents[4]
    assert "kvrag_rank" not in got[0].metadata
    plain.invoke("5: second")
    ordered = KVCachedRetriever(retriever=ListRetriever(docs=documents), llm=llm, order="frequency")
    got = ordered.invoke("0,4,5: third")
    assert [d.page_content for d in got] == [documents[i].page_content for i in (5, 4, 0)]
    assert [d.metadata["kvrag_rank"] for d in got] == [2, 1, 0] and got[0].metadata["i"] == 5
    assert "kvrag_rank" not in documents[5].metadata
    assert lc_engine.chunk_access().retrievals == 3  # one per search, never per LLM call
    got = asyncio.run(ordered.ainvoke("4,0: fourth"))
    assert [d.metadata["i"] for d in got] == [4, 0]
    with pytest.raises(ValueError, match="unknown chunk order 'popular'; use one of 'retrieval', 'frequency'"):
        KVCachedRetriever(retriever=ListRetriever(docs=documents), llm=llm, order="popular")

    store = KVCachedVectorStore(InMemoryVectorStore(DeterministicFakeEmbedding(size=16)), llm=llm, order="frequency")
    store.add_documents(documents)
    found = store.similarity_search_with_score("king", k=6)
    counts = lc_engine.access.counts("default", [d.page_content for d, _ in found])
    assert counts == sorted(counts, reverse=True)
    ranks = [d.metadata["kvrag_rank"] for d, _ in found]
    assert sorted(ranks) == list(range(6)) and all(d.metadata["kvrag_score"] == s for d, s in found)
    assert all(ranks[i] < ranks[i + 1] for i in range(5) if counts[i] == counts[i + 1])  # ties: retrieval order
    with pytest.raises(ValueError, match="unknown chunk order"):
        KVCachedVectorStore(InMemoryVectorStore(DeterministicFakeEmbedding(size=16)), llm=llm, order="x")
