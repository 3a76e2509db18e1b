"""LangChain drop-ins: change the LLM line of a RAG chain, keep the rest.

- :class:`KVCachedLLM`: a chat model (``BaseChatModel``); the model's own chat template is applied.
- :class:`KVCachedTextLLM`: a text-completion LLM (``BaseLLM``).
- :class:`KVCachedRetriever`: wraps any retriever and records the documents it returns.
- :class:`KVCachedVectorStore`: wraps a vector store (``similarity_search`` and friends record too).
- :func:`register_documents`: record documents explicitly.
- :func:`speculative_stuff_chain`: a retrieve → prompt → LLM chain around a speculative
  ``KVCachedVectorStore`` whose LLM call adopts the prefill made during the search (RAGCache).

Requires ``pip install "kvrag[langchain]"``.
"""

from kvrag.integrations.langchain.chat_models import KVCachedLLM
from kvrag.integrations.langchain.llms import KVCachedTextLLM
from kvrag.integrations.langchain.retrievers import KVCachedRetriever, KVCachedVectorStore, register_documents
from kvrag.integrations.langchain.speculation import speculative_stuff_chain

__all__ = [
    "KVCachedLLM",
    "KVCachedTextLLM",
    "KVCachedRetriever",
    "KVCachedVectorStore",
    "register_documents",
    "speculative_stuff_chain",
]
