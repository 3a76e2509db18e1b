"""Registering retrieved nodes with the engine, so it finds them inside LlamaIndex's prompts.

LlamaIndex renders a node into a prompt as ``node.get_content(MetadataMode.LLM)`` (metadata header
+ text); the response synthesizers (``compact``, ``tree_summarize``, ``refine``) strip each text
and join them with blank lines before packing them into the prompt. So each node is registered in
four forms: with and without the metadata header, each as is and stripped. The engine's segmenter
then finds whichever form the prompt holds (the longest, leftmost match wins); text it does not
find is simply computed.

The postprocessor and the retriever wrapper also count each pass once in the engine's
chunk-access table (CRAFT; a node under all its forms), however many LLM calls the synthesizer
then makes; with ``order="frequency"`` (opt-in: it changes the prompt) they return the nodes most
retrieved lately first (after the longest chunk sequence the engine holds exactly; ties in the
order their KV was first computed, else in retrieval order). Each node returned so is a copy that keeps its
score and its retrieval rank (``kvrag_rank`` in its metadata, left out of the text the LLM and
the embedder see). Use one of the two per query engine (both would count a query twice), and
reorder single-turn queries only: a chat engine's later turns keep retrieval order best.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle

from kvrag.engine.reuse.access import check_chunk_order
from kvrag.engine.types import WarmResult
from kvrag.errors import InvalidRequestError
from kvrag.integrations._shared import check_target, registrar_of
from kvrag.integrations.llama_index.speculation import check_speculative, speculative_retrieve
from kvrag.integrations.llama_index.texts import node_texts, prompt_form
from kvrag.integrations.staged_search import DEFAULT_STAGES, check_stages

__all__ = ["node_texts", "register_nodes", "order_nodes", "KVCachedNodePostprocessor", "KVCachedRetriever"]

#: Metadata key of a reordered node's retrieval rank (0 = best); hidden from the LLM and the embedder.
RANK_KEY = "kvrag_rank"


def register_nodes(target: Any, nodes: Iterable[BaseNode | NodeWithScore], warm: bool = False) -> WarmResult | None:
    """Record nodes' texts in the engine's chunk registry.

    Args:
        target: a :class:`KVCachedLLM` or an :class:`~kvrag.Engine`; ``None`` = the shared default
            engine (bundled model, default settings), as everywhere in kvrag's integrations.
        nodes: nodes or scored nodes (retrieved, or a whole docstore's ``docs.values()``).
        warm: also precompute and store their KV now, in the form the response synthesizers put
            in prompts (metadata header, stripped), so even the first query over them hits; each
            node is computed behind the ones most like it (by the nodes' own embeddings when every
            node carries one, else a lexical similarity): the context it will keep in prompts.
            This computes every node: do it ahead of time, not on the request path.

    Returns:
        The :class:`~kvrag.engine.types.WarmResult` when ``warm``, else ``None``.
    """
    engine = registrar_of(target)  # an LLM with base_url keeps them, sends them with its requests
    texts: list[str] = []
    prompt_forms: list[str] = []
    vectors: list = []
    for node in nodes:
        forms = node_texts(node)
        texts.extend(forms)
        if forms:
            prompt_forms.append(prompt_form(forms))
            vectors.append((node.node if isinstance(node, NodeWithScore) else node).embedding)
    engine.register(texts)
    if not warm:
        return None
    embeddings = vectors if vectors and all(v is not None for v in vectors) else None
    return engine.warm(prompt_forms, order="similar", embeddings=embeddings)


def order_nodes(target: Any, nodes: list[NodeWithScore], order: str = "retrieval") -> list[NodeWithScore]:
    """Count one retrieval of ``nodes`` (already registered) and return them in ``order``.

    ``"retrieval"`` returns ``nodes`` themselves; ``"frequency"`` returns copies, most retrieved
    lately first, each keeping its score and its rank (``kvrag_rank`` in the node's metadata,
    excluded from what the LLM and the embedder read, so the prompt's text is unchanged).
    """
    ranked = registrar_of(target).record_retrieval([node_texts(n) for n in nodes], order=order)
    if order == "retrieval":
        return nodes
    out = []
    for i in ranked:
        node = nodes[i].node
        copy = node.model_copy(
            update={
                "metadata": {**node.metadata, RANK_KEY: i},
                "excluded_llm_metadata_keys": [*node.excluded_llm_metadata_keys, RANK_KEY],
                "excluded_embed_metadata_keys": [*node.excluded_embed_metadata_keys, RANK_KEY],
            }
        )
        out.append(NodeWithScore(node=copy, score=nodes[i].score))
    return out


class KVCachedNodePostprocessor(BaseNodePostprocessor):
    """Registers the nodes that pass through it; returns them unchanged.

    Put it last in ``node_postprocessors`` (after rerankers and anything that rewrites node text):
    ``index.as_query_engine(llm=llm, node_postprocessors=[KVCachedNodePostprocessor(llm=llm)])``.
    Works for query engines and for chat engines such as ``condense_plus_context``.

    Args:
        llm: the :class:`KVCachedLLM` (or a kvrag :class:`~kvrag.Engine`) whose engine reads the
            prompts; ``None`` = the shared default engine.
        order: ``"retrieval"`` (default: the nodes as they come) or ``"frequency"`` (CRAFT: most
            retrieved lately first; see the module's docstring).
    """

    llm: Any = Field(
        default=None, description="The KVCachedLLM or kvrag Engine whose engine reads the prompts.", exclude=True
    )
    order: str = Field(default="retrieval", description="Node order: 'retrieval' or 'frequency' (CRAFT).")

    def __init__(self, llm: Any = None, order: str = "retrieval", **kwargs: Any) -> None:
        check_target(llm)
        super().__init__(llm=llm, order=check_chunk_order(order), **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "KVCachedNodePostprocessor"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        register_nodes(self.llm, nodes)
        return order_nodes(self.llm, nodes, self.order)


class KVCachedRetriever(BaseRetriever):
    """Wraps any LlamaIndex retriever and registers every node it returns.

    ``RetrieverQueryEngine.from_args(KVCachedRetriever(index.as_retriever(), llm), llm=llm)``

    Args:
        retriever: the retriever to wrap.
        llm: the :class:`KVCachedLLM` (or a kvrag :class:`~kvrag.Engine`) whose engine reads the
            prompts; ``None`` = the shared default engine.
        order: ``"retrieval"`` (default) or ``"frequency"`` (CRAFT), as the postprocessor's.
        speculative: RAGCache's speculative pipelining, chunk level
            (:mod:`kvrag.integrations.llama_index.speculation`): for a ``VectorStoreIndex``
            retriever over a ``FaissVectorStore`` only, the faiss search runs in ``stages`` and
            after each stage whose candidates changed the engine computes their missing KV in idle
            time. Same nodes, order and scores. Queries with metadata filters or another query mode
            run the plain retrieval. Needs a local engine.
        stages: stages of a speculative search.
        nprobe: IVF lists a speculative search scans (default the faiss index's own).
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        llm: Any = None,
        order: str = "retrieval",
        *,
        speculative: bool = False,
        stages: int = DEFAULT_STAGES,
        nprobe: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(retriever, BaseRetriever):
            raise InvalidRequestError(f"retriever must be a LlamaIndex BaseRetriever, got {type(retriever).__name__}")
        check_target(llm)
        if speculative:  # speculation: see kvrag.integrations.llama_index.speculation
            check_speculative(retriever)
            check_stages(stages)
        self.speculative, self.stages, self.nprobe = speculative, stages, nprobe
        self.retriever = retriever
        self.llm = llm
        self.order = check_chunk_order(order)
        super().__init__(
            callback_manager=kwargs.pop("callback_manager", retriever.callback_manager),
            object_map=kwargs.pop("object_map", getattr(retriever, "object_map", None)),
            verbose=kwargs.pop("verbose", getattr(retriever, "_verbose", False)),
        )
        if kwargs:
            raise InvalidRequestError(f"unknown argument(s): {', '.join(sorted(kwargs))}")

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = self._speculative_retrieve(query_bundle)
        if nodes is None:
            nodes = self.retriever.retrieve(query_bundle)
        register_nodes(self.llm, nodes)
        return order_nodes(self.llm, nodes, self.order)

    def _speculative_retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore] | None:
        """A staged search with speculation, or None (not speculative, or a query it cannot stage)."""
        if not self.speculative:
            return None
        return speculative_retrieve(self.retriever, query_bundle, self.llm, stages=self.stages, nprobe=self.nprobe)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self.speculative:  # the staged search blocks: off the loop
            nodes = await asyncio.to_thread(self._speculative_retrieve, query_bundle)
            if nodes is not None:
                await asyncio.to_thread(register_nodes, self.llm, nodes)
                return await asyncio.to_thread(order_nodes, self.llm, nodes, self.order)
        nodes = await self.retriever.aretrieve(query_bundle)
        await asyncio.to_thread(register_nodes, self.llm, nodes)  # may load the shared engine
        return await asyncio.to_thread(order_nodes, self.llm, nodes, self.order)
