"""Recording retrieved documents: ``KVCachedRetriever``, ``KVCachedVectorStore``, ``register_documents``.

Each records the text of every document it returns in the engine's chunk registry (by content
hash), so that when a chain stuffs those documents into a prompt, the engine finds them there and
reuses their KV. Nothing else changes: same documents, same order, same scores.

The wrappers also count each search once in the engine's chunk-access table (CRAFT), and with
``order="frequency"`` (opt-in: it changes the prompt the chain builds) return the documents most
retrieved lately first (after the longest chunk sequence the engine holds exactly; ties in the
order their KV was first computed, else in retrieval order), so that popular documents line up as a shared
prompt prefix that is reused exactly. Each document returned so keeps its retrieval rank
(``kvrag_rank``, 0 = best) and, where the search gave one, its score (``kvrag_score``) in its
metadata (copies: the store's own documents are not touched). Reordering is for single-turn
chains; in a conversation, reorder the first turn's retrieval only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable
from langchain_core.vectorstores import VectorStore
from pydantic import ConfigDict, Field, field_validator

from kvrag.engine import Engine
from kvrag.engine.reuse.access import check_chunk_order
from kvrag.errors import InvalidRequestError
from kvrag.integrations._shared import check_target, registrar_of
from kvrag.integrations.staged_search import DEFAULT_STAGES, check_stages, speculating_search

__all__ = ["register_documents", "order_documents", "KVCachedRetriever", "KVCachedVectorStore"]


def register_documents(documents: Iterable[Document | str], llm: Any = None, *, warm: bool = False) -> list[str]:
    """Record documents' text so that ``llm`` reuses their KV wherever a prompt contains them.

    Args:
        documents: LangChain documents (their ``page_content``) or plain strings.
        llm: the :class:`KVCachedLLM` / :class:`KVCachedTextLLM` (or :class:`~kvrag.Engine`) that
            will answer; ``None`` = the shared default engine (bundled model, default settings).
            An LLM with ``base_url`` sends the documents with the requests whose prompt holds them.
        warm: also compute and store their KV now, each document behind the ones most like it
            (``Engine.warm(order="similar")``: the context it will keep in prompts), so even the
            first question over them hits. This computes every document: do it ahead of time
            (e.g. when the corpus is loaded), not on the request path.

    Returns:
        The documents' content ids, in order.
    """
    texts = []
    for d in documents:
        text = d.page_content if isinstance(d, Document) else d
        if not isinstance(text, str):
            raise InvalidRequestError(f"documents must be Documents or strings, got {type(d).__name__}")
        texts.append(text)
    registrar = registrar_of(llm)
    ids = registrar.register(texts)
    if warm and texts:
        registrar.warm(texts, order="similar")
    return ids


# -- CRAFT's chunk order (kvrag.engine.reuse.access) ------------------------------------------------


def _retrieved(docs: list[Document], llm: Any, order: str) -> list[int]:
    """Count one retrieval of ``docs`` for ``llm``; the indices of ``docs`` in the prompt order asked for."""
    return registrar_of(llm).record_retrieval([d.page_content for d in docs], order=order)


def _ranked(doc: Document, rank: int, score: float | None) -> Document:
    """A copy of ``doc`` that keeps its retrieval rank (and score) in its metadata."""
    meta = {**doc.metadata, "kvrag_rank": rank}
    if score is not None:
        meta["kvrag_score"] = float(score)
    return doc.model_copy(update={"metadata": meta})


def order_documents(docs: list[Document], llm: Any = None, *, order: str = "retrieval") -> list[Document]:
    """Count one retrieval of ``docs`` (already registered) and return them in ``order``.

    ``"retrieval"`` returns ``docs`` themselves; ``"frequency"`` returns copies, most retrieved
    lately first, each with its ``kvrag_rank`` (and ``kvrag_score`` from its metadata's ``score``
    when the retriever put one there).
    """
    ranked = _retrieved(docs, llm, order)
    if order == "retrieval":
        return docs
    return [_ranked(docs[i], i, docs[i].metadata.get("score")) for i in ranked]


def _order_scored(pairs: list[tuple[Document, float]], llm: Any, order: str) -> list[tuple[Document, float]]:
    ranked = _retrieved([d for d, _ in pairs], llm, order)
    if order == "retrieval":
        return pairs
    return [(_ranked(pairs[i][0], i, pairs[i][1]), pairs[i][1]) for i in ranked]


class KVCachedRetriever(BaseRetriever):
    """Wraps any retriever; records the documents it returns (see :func:`register_documents`).

    Example:
        .. code-block:: python

            retriever = KVCachedRetriever(retriever=vectorstore.as_retriever(k=6), llm=llm)

    ``order="frequency"`` returns the documents most retrieved lately first (CRAFT; see the
    module's docstring); ``"retrieval"`` (default) as the wrapped retriever ranked them.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    retriever: Runnable
    """The wrapped retriever (any runnable from a query string to a list of documents)."""
    llm: Any = Field(default=None, exclude=True)
    """The kvrag LLM (or engine) the documents are recorded for; ``None`` = the shared default engine."""
    order: str = "retrieval"
    """How the documents are returned: ``retrieval`` (default: as ranked) or ``frequency`` (CRAFT's, opt-in)."""

    @field_validator("order")
    @classmethod
    def _check_order(cls, value: Any) -> str:
        return check_chunk_order(value)

    @field_validator("llm")
    @classmethod
    def _check_llm(cls, value: Any) -> Any:
        check_target(value)  # a wrong target fails here, not at the first retrieval
        return value

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        docs = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()})
        register_documents(docs, self.llm)
        return order_documents(docs, self.llm, order=self.order)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        docs = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()})
        await asyncio.to_thread(register_documents, docs, self.llm)  # may load the engine: off the loop
        return await asyncio.to_thread(order_documents, docs, self.llm, order=self.order)


class KVCachedVectorStore(VectorStore):
    """Wraps a vector store; every search records the documents it returns.

    Searches, ``as_retriever()`` and writes go to the wrapped store; any other attribute (e.g.
    FAISS's ``save_local``) is looked up on it too.

    Example:
        .. code-block:: python

            store = KVCachedVectorStore(FAISS.from_documents(docs, embeddings), llm=llm)
            docs = store.similarity_search(question, k=6)   # as in LangChain's RAG tutorial

    ``order="frequency"`` returns every search's documents most retrieved lately first (CRAFT;
    see the module's docstring); ``"retrieval"`` (default) as the wrapped store ranked them.
    """

    def __init__(
        self,
        vectorstore: VectorStore,
        llm: Any = None,
        *,
        order: str = "retrieval",
        speculative: bool = False,
        stages: int = DEFAULT_STAGES,
        nprobe: int | None = None,
    ) -> None:
        """
        Args:
            vectorstore: the LangChain vector store to wrap.
            llm: the kvrag LLM (or engine) the documents are recorded for; ``None`` = the shared
                default engine.
            order: ``"retrieval"`` (default: as the wrapped store ranked them) or ``"frequency"``
                (CRAFT: see the module's docstring). Prompt-level speculation
                (:func:`~kvrag.integrations.langchain.speculative_stuff_chain`) speculates the
                retrieval order: with ``"frequency"`` its speculations are not adopted (chunk-level
                speculation still pays).
            speculative: RAGCache's speculative pipelining, chunk level: a FAISS store's search
                runs in ``stages`` (:mod:`kvrag.integrations.staged_search`), and after each stage
                whose candidates changed the engine computes their missing KV in idle time
                (:meth:`~kvrag.Engine.speculate`). Same documents, same order, same scores. It pays
                when the search is slow (a large IVF index at a high ``nprobe``) and the engine is
                idle. Needs a local engine. Staged: ``similarity_search``,
                ``similarity_search_with_score`` and ``similarity_search_by_vector`` with ``k``
                only (so ``as_retriever()``'s default search too). Everything else runs the wrapped
                store's plain search, recorded but not speculated: the async searches
                (``asimilarity_search``, ...), searches given keywords (``filter``, ``fetch_k``,
                ...), relevance-score and MMR searches. Prompt-level speculation (the prompt the
                chain will send, adopted by its LLM call) is
                :func:`~kvrag.integrations.langchain.speculative_stuff_chain`.
            stages: stages of a speculative search.
            nprobe: IVF lists a speculative search scans (default the index's own).
        """
        if not isinstance(vectorstore, VectorStore):
            raise InvalidRequestError(f"vectorstore must be a LangChain VectorStore, got {type(vectorstore).__name__}")
        check_target(llm)
        if speculative and not all(hasattr(vectorstore, a) for a in ("index", "index_to_docstore_id", "docstore")):
            raise InvalidRequestError(
                f"speculative=True needs a FAISS vector store (a faiss index), got {type(vectorstore).__name__}"
            )
        check_stages(stages)
        self.vectorstore = vectorstore
        self.llm = llm
        self.speculative, self.stages, self.nprobe = speculative, stages, nprobe
        self.order = check_chunk_order(order)

    def _staged(
        self, embedding, k: int, kwargs: dict, speculate: Callable[[list[Document]], Any] | None = None
    ) -> list[tuple[Document, float]] | None:
        """A speculative FAISS search (as FAISS's own ``similarity_search_with_score_by_vector``), or
        None where it does not apply (not speculative, or keywords it does not take). ``speculate``:
        what to start on each changed candidate list instead of the chunk-level speculation
        (``staged_search.speculating_search``'s, given the documents)."""
        if not self.speculative or kwargs:
            return None
        engine = registrar_of(self.llm)
        if not isinstance(engine, Engine):
            raise InvalidRequestError("speculative=True needs a local engine, not an LLM with base_url")
        store = self.vectorstore
        vector = np.array([embedding], dtype=np.float32)
        if getattr(store, "_normalize_L2", False):
            import faiss  # a FAISS store: installed

            faiss.normalize_L2(vector)  # as the store does (in place)

        def documents(ids) -> list[Document]:
            return [store.docstore.search(store.index_to_docstore_id[int(i)]) for i in ids if i != -1]

        last = speculating_search(
            engine,
            store.index,
            vector,
            k,
            lambda ids: [d.page_content for d in documents(ids) if isinstance(d, Document)],
            stages=self.stages,
            nprobe=self.nprobe,
            speculate=None if speculate is None else lambda ids: speculate(documents(ids)),
        )
        pairs = []
        for doc, score in zip(documents(last.ids[0]), last.distances[0][last.ids[0] != -1]):
            if not isinstance(doc, Document):
                raise ValueError(f"the docstore has no document for a search result ({doc!r})")
            pairs.append((doc, score))
        return pairs

    def __getattr__(self, name: str) -> Any:
        if name == "vectorstore":  # not set yet (copy/pickle): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.vectorstore, name)

    def _record(self, docs: list[Document]) -> list[Document]:
        register_documents(docs, self.llm)
        return order_documents(docs, self.llm, order=self.order)

    def _record_scored(self, pairs: list[tuple[Document, float]]) -> list[tuple[Document, float]]:
        register_documents([d for d, _ in pairs], self.llm)
        return _order_scored(pairs, self.llm, self.order)

    async def _arecord(self, docs: list) -> list:
        scored = bool(docs) and isinstance(docs[0], tuple)
        return await asyncio.to_thread(self._record_scored if scored else self._record, docs)

    # -- writes and properties: the wrapped store's ------------------------------------------------

    @property
    def embeddings(self) -> Embeddings | None:
        return self.vectorstore.embeddings

    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, **kwargs: Any) -> list[str]:
        return self.vectorstore.add_texts(texts, metadatas, **kwargs)

    async def aadd_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, **kwargs: Any) -> list[str]:
        return await self.vectorstore.aadd_texts(texts, metadatas, **kwargs)

    def add_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        return self.vectorstore.add_documents(documents, **kwargs)

    async def aadd_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        return await self.vectorstore.aadd_documents(documents, **kwargs)

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        return self.vectorstore.delete(ids, **kwargs)

    async def adelete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        return await self.vectorstore.adelete(ids, **kwargs)

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return self.vectorstore.get_by_ids(ids)

    async def aget_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return await self.vectorstore.aget_by_ids(ids)

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return self.vectorstore._select_relevance_score_fn()

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings, metadatas: list[dict] | None = None, **kwargs: Any):
        raise NotImplementedError(
            "build the store with its own class, then wrap it: KVCachedVectorStore(FAISS.from_texts(...))"
        )

    # -- searches: the wrapped store's, recorded -----------------------------------------------------

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        if self.speculative and not kwargs:
            return [d for d, _ in self.similarity_search_with_score(query, k=k)]
        return self._record(self.vectorstore.similarity_search(query, k=k, **kwargs))

    async def asimilarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return await self._arecord(await self.vectorstore.asimilarity_search(query, k=k, **kwargs))

    def similarity_search_with_score(self, *args: Any, **kwargs: Any) -> list[tuple[Document, float]]:
        if self.speculative and len(args) == 1 and set(kwargs) <= {"k"}:
            staged = self._staged(self.vectorstore._embed_query(args[0]), kwargs.get("k", 4), {})
            if staged is not None:
                return self._record_scored(staged)
        return self._record_scored(self.vectorstore.similarity_search_with_score(*args, **kwargs))

    async def asimilarity_search_with_score(self, *args: Any, **kwargs: Any) -> list[tuple[Document, float]]:
        return await self._arecord(await self.vectorstore.asimilarity_search_with_score(*args, **kwargs))

    def similarity_search_with_relevance_scores(self, query: str, k: int = 4, **kwargs: Any):
        return self._record_scored(self.vectorstore.similarity_search_with_relevance_scores(query, k=k, **kwargs))

    async def asimilarity_search_with_relevance_scores(self, query: str, k: int = 4, **kwargs: Any):
        return await self._arecord(
            await self.vectorstore.asimilarity_search_with_relevance_scores(query, k=k, **kwargs)
        )

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        staged = self._staged(embedding, k, kwargs)
        if staged is not None:
            return self._record([d for d, _ in staged])
        return self._record(self.vectorstore.similarity_search_by_vector(embedding, k=k, **kwargs))

    async def asimilarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        return await self._arecord(await self.vectorstore.asimilarity_search_by_vector(embedding, k=k, **kwargs))

    def max_marginal_relevance_search(
        self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        return self._record(self.vectorstore.max_marginal_relevance_search(query, k, fetch_k, lambda_mult, **kwargs))

    async def amax_marginal_relevance_search(
        self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        docs = await self.vectorstore.amax_marginal_relevance_search(query, k, fetch_k, lambda_mult, **kwargs)
        return await self._arecord(docs)

    def max_marginal_relevance_search_by_vector(
        self, embedding: list[float], k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        docs = self.vectorstore.max_marginal_relevance_search_by_vector(embedding, k, fetch_k, lambda_mult, **kwargs)
        return self._record(docs)

    async def amax_marginal_relevance_search_by_vector(
        self, embedding: list[float], k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        docs = await self.vectorstore.amax_marginal_relevance_search_by_vector(
            embedding, k, fetch_k, lambda_mult, **kwargs
        )
        return await self._arecord(docs)
