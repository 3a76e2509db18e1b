"""KVCachedVectorStore(speculative=True): a staged FAISS search that has the engine warm its candidates."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("langchain_core")
faiss = pytest.importorskip("faiss")
lc_faiss = pytest.importorskip("langchain_community.vectorstores.faiss")

from langchain_community.docstore.in_memory import InMemoryDocstore  # noqa: E402
from langchain_core.embeddings.fake import DeterministicFakeEmbedding  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from kvrag import Engine, InvalidRequestError, SamplingParams  # noqa: E402
from kvrag.integrations.langchain import KVCachedVectorStore  # noqa: E402
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
