"""LlamaIndex drop-ins: ``KVCachedLLM`` and node registration (postprocessor, retriever wrapper).

Change the LLM, add one postprocessor, and retrieved nodes' KV is reused across queries::

    from kvrag.integrations.llama_index import KVCachedLLM, minilm_embedding

    llm = KVCachedLLM()
    index = VectorStoreIndex(nodes, embed_model=minilm_embedding())
    qe = index.as_query_engine(llm=llm, node_postprocessors=[llm.node_postprocessor()])

Needs ``pip install 'kvrag[llama-index]'``.
"""

from __future__ import annotations

try:
    import llama_index.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("kvrag.integrations.llama_index needs `pip install 'kvrag[llama-index]'`") from exc

from kvrag.integrations.llama_index.base import KVCachedLLM, generation_info
from kvrag.integrations.llama_index.conversation import conversation, current_conversation
from kvrag.integrations.llama_index.embeddings import minilm_embedding
from kvrag.integrations.llama_index.nodes import KVCachedNodePostprocessor, KVCachedRetriever, register_nodes
from kvrag.integrations.llama_index.stats import KVStatsHandler, record_stats
from kvrag.integrations.llama_index.texts import node_texts

__all__ = [
    "KVCachedLLM",
    "KVCachedNodePostprocessor",
    "KVCachedRetriever",
    "KVStatsHandler",
    "conversation",
    "current_conversation",
    "generation_info",
    "minilm_embedding",
    "node_texts",
    "record_stats",
    "register_nodes",
]
