"""KVCachedVectorStore(speculative=True): a staged FAISS search that has the engine warm its candidates
(chunk level), and speculative_stuff_chain: the prompt the chain will send, prefilled meanwhile."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("langchain_core")
faiss = pytest.importorskip("faiss")
lc_faiss = pytest.importorskip("langchain_community.vectorstores.faiss")

from langchain_community.docstore.in_memory import InMemoryDocstore  # noqa: E402
from langchain_core.embeddings.fake import DeterministicFakeEmbedding  # noqa: E402
from langchain_core.messages import AIMessage  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from kvrag import Engine, InvalidRequestError, SamplingParams  # noqa: E402
from kvrag.integrations.langchain import (  # noqa: E402
    KVCachedLLM,
    KVCachedTextLLM,
    KVCachedVectorStore,
    speculative_stuff_chain,
)
from kvrag.integrations.langchain.speculation import join_documents  # noqa: E402
from tests.helpers import make_docs  # noqa: E402

DIM = 32


@pytest.fixture
def engine(tiny_model, tiny_tokenizer, one_thread):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=4))
    yield engine
    engine.close()


def ivf_store(texts, normalize=False):
    embeddings = DeterministicFakeEmbedding(size=DIM)
    vectors = np.array(embeddings.embed_documents(texts), dtype=np.float32)
    if normalize:
        faiss.normalize_L2(vectors)
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(DIM), DIM, 8)
    index.train(np.concatenate([vectors, np.random.default_rng(0).standard_normal((400, DIM)).astype("float32")]))
    index.add(vectors)
    index.nprobe = 6
    ids = [str(i) for i in range(len(texts))]
    docstore = InMemoryDocstore({i: lc_faiss.Document(page_content=t, id=i) for i, t in zip(ids, texts)})
    return lc_faiss.FAISS(embeddings, index, docstore, dict(enumerate(ids)), normalize_L2=normalize)


@pytest.mark.parametrize("normalize", [False, True])
def test_speculative_search_returns_what_the_store_returns_and_warms_candidates(engine, normalize):
    texts = make_docs(30, words=20, seed=71)
    store = ivf_store(texts, normalize)
    wrapped = KVCachedVectorStore(store, engine, speculative=True, stages=3)
    for query in ("the king was born", "a river flows", "where is the castle"):
        expected = store.similarity_search_with_score(query, k=4)
        got = wrapped.similarity_search_with_score(query, k=4)
        assert [d.page_content for d, _ in got] == [d.page_content for d, _ in expected]
        np.testing.assert_allclose([s for _, s in got], [s for _, s in expected], rtol=1e-6)
        assert [d.page_content for d in wrapped.similarity_search(query, k=4)] == [d.page_content for d, _ in got]
    assert store.index.nprobe == 6
    assert engine._worker.wait_idle(30)  # the last speculation finishes
    counts = engine.speculations.counts
    assert counts["started"] >= 1 and counts["done"] + counts["stopped"] == counts["started"]
    # the documents returned are registered: a prompt holding them finds them
    assert engine.split_prompt("x " + got[0][0].page_content)[1][0] == "chunk"
    warmed = [
        t
        for t in texts
        if engine.store.contains(engine.planner.chunk_key(engine.prompt_tokenizer.tokenize(t), "default"))
    ]
    assert warmed and not engine.store.stats()["hits"]


def test_keywords_run_the_plain_search(engine):
    texts = make_docs(10, words=20, seed=72)
    store = ivf_store(texts)
    wrapped = KVCachedVectorStore(store, engine, speculative=True)
    got = wrapped.similarity_search("the king", k=3, fetch_k=5)
    assert [d.page_content for d in got] == [
        d.page_content for d in store.similarity_search("the king", k=3, fetch_k=5)
    ]
    assert engine.speculations.counts["started"] == 0


def test_speculative_needs_a_faiss_store_and_good_stages(engine):
    plain = InMemoryVectorStore(DeterministicFakeEmbedding(size=DIM))
    with pytest.raises(InvalidRequestError, match="FAISS"):
        KVCachedVectorStore(plain, engine, speculative=True)
    with pytest.raises(InvalidRequestError, match="stages"):
        KVCachedVectorStore(ivf_store(make_docs(3)), engine, speculative=True, stages=0)
    KVCachedVectorStore(plain, engine)  # not speculative: any store


# -- prompt-level: speculative_stuff_chain -------------------------------------------------------------

PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the documents.\n\n{context}"), ("human", "{question}")]
)
#: stages (3 over nprobe 6) changed per query of ``ivf_store(make_docs(30, words=20, seed=71))`` at k=3:
#: q0 [T, T, F] (one list lost, the last won), q2 [T, T, T] (both lost), q3 [T, F, T] (lost), q6 [T, F, F] (won)
QUERIES = [f"question {i} about the king" for i in (0, 2, 3, 6)]


@pytest.fixture
def reference(tiny_model, tiny_tokenizer, one_thread):
    """An engine of the same model that never speculates."""
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=4))
    yield engine
    engine.close()


@pytest.fixture
def settled(monkeypatch):
    """A slow search: each stage's speculation finishes before the next stage is searched (so whether
    a call adopts depends only on the lists, not on timing)."""
    from kvrag.integrations import staged_search as module

    original, engines = module.staged_search, []

    def slow(*args, **kwargs):
        for stage in original(*args, **kwargs):
            yield stage
            for engine in engines:  # the consumer has speculated on this stage by now
                assert engine._worker.wait_idle(30)

    monkeypatch.setattr(module, "staged_search", slow)
    return engines


def spy_speculations(engine) -> list:
    started = []
    original = engine.speculate_request

    def speculate_request(*args, **kwargs):
        handle = original(*args, **kwargs)
        started.append(handle)
        return handle

    engine.speculate_request = speculate_request
    return started


def plain_chain(store, llm, k=3):
    """The user's own chain, as in LangChain's RAG tutorial (no speculation)."""
    retriever = KVCachedVectorStore(store, llm).as_retriever(search_kwargs={"k": k})
    return {"context": retriever | join_documents, "question": RunnablePassthrough()} | PROMPT | llm


def test_stuff_chain_adopts_the_speculated_prompt_and_answers_as_the_plain_chain(engine, reference, settled):
    """Won lists are adopted, lost ones cancelled; every answer equals the plain chain's on an engine
    that never speculates (greedy), and the cache ends as that engine's does."""
    settled.append(engine)
    store = ivf_store(make_docs(30, words=20, seed=71))
    llm = KVCachedLLM(engine=engine)
    chain = speculative_stuff_chain(KVCachedVectorStore(store, llm, speculative=True, stages=3), PROMPT, llm, k=3)
    plain = plain_chain(store, KVCachedLLM(engine=reference))
    started = spy_speculations(engine)
    for query in QUERIES + QUERIES[:1]:  # the last one again: its chunks are cached by now
        got, expected = chain.invoke(query), plain.invoke(query)
        assert isinstance(got, AIMessage) and got.content == expected.content, query
        engine.flush()
        reference.flush()
    states = [h.state for h in started]
    assert states.count("adopted") == 3  # q0, q6, q0 again: the final list was the last speculated
    assert set(states) == {"adopted", "cancelled"} and engine.speculations.counts["wasted_tokens"] > 0
    assert not engine.speculations.live()  # nothing held
    assert engine.store.stats()["hits"] == reference.store.stats()["hits"]
    assert engine.store.stats()["puts"] == reference.store.stats()["puts"]


def test_stuff_chain_streams_and_runs_async(engine, settled):
    settled.append(engine)
    store = ivf_store(make_docs(30, words=20, seed=71))
    llm = KVCachedLLM(engine=engine)
    chain = speculative_stuff_chain(KVCachedVectorStore(store, llm, speculative=True, stages=3), PROMPT, llm, k=3)
    expected = plain_chain(store, llm).invoke(QUERIES[0]).content
    engine.flush()  # write-back done before each call (it would preempt a speculation: timing)
    started = spy_speculations(engine)
    assert "".join(c.content for c in chain.stream(QUERIES[0])) == expected
    assert started[-1].state == "adopted"
    engine.flush()

    async def run():
        streamed = [c.content async for c in chain.astream({"question": QUERIES[0]})]
        engine.flush()
        return "".join(streamed), (await chain.ainvoke(QUERIES[0])).content

    assert asyncio.run(run()) == (expected, expected)
    assert [h.state for h in started[-4:]].count("adopted") == 2


def test_text_llm_chain_adopts_too(engine, reference, settled):
    settled.append(engine)
    store = ivf_store(make_docs(30, words=20, seed=71))
    prompt = PromptTemplate.from_template("Documents:\n{context}\n\nQuestion: {question}\nAnswer:")
    llm = KVCachedTextLLM(engine=engine, chat_template=True)
    chain = speculative_stuff_chain(KVCachedVectorStore(store, llm, speculative=True, stages=3), prompt, llm, k=3)
    ref_llm = KVCachedTextLLM(engine=reference, chat_template=True)
    retriever = KVCachedVectorStore(store, ref_llm).as_retriever(search_kwargs={"k": 3})
    plain = {"context": retriever | join_documents, "question": RunnablePassthrough()} | prompt | ref_llm
    started = spy_speculations(engine)
    assert chain.invoke(QUERIES[3]) == plain.invoke(QUERIES[3])
    assert [h.state for h in started] == ["adopted"]


def test_a_speculation_nobody_adopts_is_released(engine, settled):
    """An LLM cache answers the second call: its held speculation is cancelled when the call ends."""
    from langchain_core.caches import InMemoryCache

    settled.append(engine)
    store = ivf_store(make_docs(30, words=20, seed=71))
    llm = KVCachedLLM(engine=engine, cache=InMemoryCache())
    chain = speculative_stuff_chain(KVCachedVectorStore(store, llm, speculative=True, stages=3), PROMPT, llm, k=3)
    started = spy_speculations(engine)
    first = chain.invoke(QUERIES[3])
    engine.flush()  # its write-back done: the next speculation has the engine to itself
    second = chain.invoke(QUERIES[3])
    assert first.content == second.content
    assert [h.state for h in started] == ["adopted", "cancelled"] and not engine.speculations.live()


def test_conversation_turns_and_plain_stores_are_not_prompt_speculated(engine):
    store = ivf_store(make_docs(30, words=20, seed=71))
    llm = KVCachedLLM(engine=engine)
    started = spy_speculations(engine)
    speculative = speculative_stuff_chain(KVCachedVectorStore(store, llm, speculative=True), PROMPT, llm, k=3)
    speculative.invoke(QUERIES[0], config={"configurable": {"session_id": "s1"}})
    plain = speculative_stuff_chain(KVCachedVectorStore(store, llm), PROMPT, llm, k=3)
    assert plain.invoke(QUERIES[0]).content == plain_chain(store, llm).invoke(QUERIES[0]).content
    assert started == []


def test_stuff_chain_checks_its_parts(engine, tiny_model, tiny_tokenizer):
    store = ivf_store(make_docs(5))
    llm = KVCachedLLM(engine=engine)
    with pytest.raises(InvalidRequestError, match="KVCachedVectorStore"):
        speculative_stuff_chain(store, PROMPT, llm)
    with pytest.raises(InvalidRequestError, match="llm"):
        speculative_stuff_chain(KVCachedVectorStore(store, llm), PROMPT, object())
    with pytest.raises(InvalidRequestError, match="k must"):
        speculative_stuff_chain(KVCachedVectorStore(store, llm), PROMPT, llm, k=0)
    other = Engine.from_model(tiny_model, tiny_tokenizer)
    try:
        chain = speculative_stuff_chain(KVCachedVectorStore(store, other, speculative=True), PROMPT, llm)
        with pytest.raises(InvalidRequestError, match="another engine"):
            chain.invoke("where is the castle")
    finally:
        other.close()
