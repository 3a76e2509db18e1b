"""Chunk-level speculation for LlamaIndex retrieval over a ``FaissVectorStore`` (RAGCache §5.3).

LlamaIndex's vector store abstraction answers a query in one call (``vector_store.query``): it
cannot report a top-k in stages. So ``KVCachedRetriever(..., speculative=True)`` reaches under it
for the one store where it can: a ``VectorIndexRetriever`` over a ``FaissVectorStore``. It runs
the faiss index's search itself in stages (:func:`kvrag.integrations.staged_search.speculating_search`),
has the engine compute the missing KV of each changed candidate list in idle time (in the form
the response synthesizers put into prompts), and builds the retriever's result from the final
stage as ``VectorIndexRetriever`` does (the index's id map, the docstore, faiss's distances as
scores): the same nodes, in the same order, with the same scores. A query it cannot stage (metadata
filters, which ``FaissVectorStore`` refuses, or a query mode other than the default) runs the
wrapped retriever as usual. (Documents at exactly equal distances may come in another order than
faiss's own: its heap orders ties by scan order.)

The prompt itself is not speculated: LlamaIndex's response synthesizers pack, split and refine
the nodes in ways the retriever cannot foresee.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.vector_stores.types import VectorStoreQueryMode

from kvrag.engine import Engine
from kvrag.errors import InvalidRequestError
from kvrag.integrations._shared import registrar_of
from kvrag.integrations.llama_index.texts import node_texts, prompt_form
from kvrag.integrations.staged_search import speculating_search

__all__ = ["check_speculative", "speculative_retrieve"]


def _faiss_index(retriever: BaseRetriever) -> Any:
    """The faiss index under a ``VectorIndexRetriever`` over a ``FaissVectorStore``, or None."""
    from llama_index.core.indices.vector_store.retrievers import VectorIndexRetriever

    if not isinstance(retriever, VectorIndexRetriever):
        return None
    store = retriever._vector_store
    if type(store).__name__ != "FaissVectorStore" or store.stores_text:  # an optional package: by name
        return None
    return store.client


def check_speculative(retriever: BaseRetriever) -> None:
    """Raise unless ``retriever`` is one a speculative search can stage."""
    if _faiss_index(retriever) is None:
        raise InvalidRequestError(
            "speculative=True needs a VectorStoreIndex retriever over a FaissVectorStore "
            f"(index.as_retriever()), got {type(retriever).__name__}"
        )


def speculative_retrieve(
    retriever: BaseRetriever,
    query_bundle: QueryBundle,
    target: Any,
    *,
    stages: int,
    nprobe: int | None,
) -> list[NodeWithScore] | None:
    """``retriever.retrieve(query_bundle)`` as a staged faiss search with chunk-level speculation,
    or None where the query cannot be staged (the caller runs the plain retrieval).

    Args:
        retriever: a ``VectorIndexRetriever`` over a ``FaissVectorStore`` (:func:`check_speculative`).
        query_bundle: the query.
        target: the kvrag LLM or engine whose engine computes the candidates (a local one).
        stages, nprobe: as for :func:`~kvrag.integrations.staged_search.staged_search`.
    """
    r: Any = retriever
    # FaissVectorStore.query reads the query's embedding, top-k and filters (which it refuses) only:
    # node_ids (as_retriever() passes every node's), doc_ids and vector-store arguments it ignores
    if r._filters is not None or r._vector_store_query_mode != VectorStoreQueryMode.DEFAULT or not r._needs_embedding():
        return None
    engine = registrar_of(target)
    if not isinstance(engine, Engine):
        raise InvalidRequestError("speculative=True needs a local engine, not an LLM with base_url")
    if query_bundle.embedding is None and len(query_bundle.embedding_strs) > 0:  # as VectorIndexRetriever
        query_bundle.embedding = r._embed_model.get_agg_embedding_from_queries(query_bundle.embedding_strs)
    if query_bundle.embedding is None:
        return None
    nodes_dict = r._index.index_struct.nodes_dict
    docstore = r._docstore

    def nodes(ids) -> list:
        node_ids = [nodes_dict[str(int(i))] for i in ids if i >= 0]
        found = {n.node_id: n for n in docstore.get_nodes(node_ids, raise_error=False)}
        return [found.get(node_id) for node_id in node_ids]

    def texts(ids) -> list[str]:
        # the form the response synthesizers put into prompts: metadata header, stripped
        forms = (prompt_form(node_texts(n)) for n in nodes(ids) if n is not None)
        return [form for form in forms if form is not None]

    vector = np.array([query_bundle.embedding], dtype=np.float32)
    last = speculating_search(
        engine, _faiss_index(retriever), vector, r._similarity_top_k, texts, stages=stages, nprobe=nprobe
    )
    ids, distances = last.ids[0], last.distances[0]
    found = nodes(ids)
    out = []
    for node, score in zip(found, distances[ids >= 0]):
        if node is None:
            raise KeyError("a search result's node is not in the index's docstore")
        out.append(NodeWithScore(node=node, score=float(score)))
    return out
