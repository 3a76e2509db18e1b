"""KVCachedRetriever(speculative=True) over a FaissVectorStore: a staged faiss search that has the
engine compute its candidates' KV meanwhile; same nodes, order and scores as the plain retriever."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

faiss = pytest.importorskip("faiss")
pytest.importorskip("llama_index.vector_stores.faiss")

from llama_index.core import StorageContext, VectorStoreIndex  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402
from llama_index.core.vector_stores.types import ExactMatchFilter, MetadataFilters  # noqa: E402
from llama_index.vector_stores.faiss import FaissVectorStore  # noqa: E402

from kvrag import Engine, InvalidRequestError, SamplingParams  # noqa: E402
from kvrag.integrations.llama_index import KVCachedLLM, KVCachedRetriever  # noqa: E402
from tests.helpers import make_docs  # noqa: E402
from tests.integrations.llama_index_helpers import BowEmbedding, no_default_models  # noqa: E402, F401 (autouse fixture)

DIM = 64  # BowEmbedding's
QUERIES = ["where was the king born", "a river flows by the castle", "the old bridge", "who wrote the letter"]


@pytest.fixture
def engine(tiny_model, tiny_tokenizer, one_thread):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=4))
    yield engine
    engine.close()


class UntiedBow(BowEmbedding):
    """Bag of words plus a little per-text noise: no two documents at exactly the same distance (faiss
    orders ties by its heap, the staged merge by scan order)."""

    def _vec(self, text: str) -> list[float]:
        seed = int(hashlib.md5(text.encode()).hexdigest(), 16) % 2**32
        v = np.array(super()._vec(text)) + 1e-3 * np.random.default_rng(seed).standard_normal(DIM)
        return (v / np.linalg.norm(v)).tolist()


def faiss_index(n=40, nprobe=6):
    """A VectorStoreIndex over an IVF FaissVectorStore (trained on random unit vectors first)."""
    quantizer = faiss.IndexFlatL2(DIM)
    ivf = faiss.IndexIVFFlat(quantizer, DIM, 8)
    train = np.random.default_rng(0).standard_normal((400, DIM)).astype("float32")
    faiss.normalize_L2(train)
    ivf.train(train)
    ivf.nprobe = nprobe
    nodes = [TextNode(text=t, metadata={"title": f"doc {i}"}, id_=f"n{i}") for i, t in enumerate(make_docs(n, 20, 81))]
    storage = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=ivf))
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=UntiedBow()), ivf


def same(got, expected):
    assert [n.node.node_id for n in got] == [n.node.node_id for n in expected]
    np.testing.assert_allclose([n.score for n in got], [n.score for n in expected], rtol=1e-6)


def test_speculative_retrieval_returns_the_plain_nodes_and_warms_candidates(engine):
    index, ivf = faiss_index()
    plain = index.as_retriever(similarity_top_k=3)
    wrapped = KVCachedRetriever(index.as_retriever(similarity_top_k=3), engine, speculative=True, stages=3)
    for query in QUERIES:
        same(wrapped.retrieve(query), plain.retrieve(query))
    same(asyncio.run(wrapped.aretrieve(QUERIES[0])), plain.retrieve(QUERIES[0]))
    assert ivf.nprobe == 6
    assert engine._worker.wait_idle(30)
    counts = engine.speculations.counts
    # every query speculated its first stage: it ran, or a newer list replaced it before it started
    assert counts["started"] >= 1 and counts["started"] + counts["cancelled"] >= len(QUERIES)
    assert counts["done"] + counts["stopped"] == counts["started"]
    assert not engine.store.stats()["hits"]  # speculation never counts as a use
    warmed = [
        n
        for n in index.docstore.docs.values()
        if engine.store.contains(
            engine.planner.chunk_key(engine.prompt_tokenizer.tokenize(n.get_content("llm").strip()), "default")
        )
    ]
    assert warmed
    # the nodes returned are registered: the engine finds them inside a prompt
    node = wrapped.retrieve(QUERIES[0])[0].node
    assert engine.split_prompt("x " + node.get_content("llm"))[1][0] == "chunk"


def test_a_query_engine_over_the_speculative_retriever_answers_as_the_plain_one(engine):
    index, _ = faiss_index()
    llm = KVCachedLLM(engine=engine, mode="full")
    speculative = RetrieverQueryEngine.from_args(
        KVCachedRetriever(index.as_retriever(similarity_top_k=3), llm, speculative=True), llm=llm
    )
    plain = RetrieverQueryEngine.from_args(KVCachedRetriever(index.as_retriever(similarity_top_k=3), llm), llm=llm)
    for query in QUERIES[:2]:
        assert str(speculative.query(query)) == str(plain.query(query))
    assert engine.speculations.counts["started"] >= 1


def test_queries_it_cannot_stage_run_the_plain_retrieval(engine):
    index, _ = faiss_index()
    filters = MetadataFilters(filters=[ExactMatchFilter(key="title", value="doc 1")])
    wrapped = KVCachedRetriever(index.as_retriever(similarity_top_k=3, filters=filters), engine, speculative=True)
    with pytest.raises(ValueError, match="filters"):  # FaissVectorStore's own refusal: the plain path ran
        wrapped.retrieve(QUERIES[0])
    assert engine.speculations.counts["started"] == 0


def test_speculative_needs_a_faiss_vector_store(engine):
    plain_index = VectorStoreIndex(
        [TextNode(text=t) for t in make_docs(3)], embed_model=BowEmbedding()
    )  # the default in-memory store
    with pytest.raises(InvalidRequestError, match="FaissVectorStore"):
        KVCachedRetriever(plain_index.as_retriever(), engine, speculative=True)
    index, _ = faiss_index(5)
    with pytest.raises(InvalidRequestError, match="stages"):
        KVCachedRetriever(index.as_retriever(), engine, speculative=True, stages=0)
    KVCachedRetriever(plain_index.as_retriever(), engine)  # not speculative: any retriever
