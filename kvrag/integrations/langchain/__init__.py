"""LangChain drop-ins: change the LLM line of a RAG chain, keep the rest.

- :class:`KVCachedLLM`: a chat model (``BaseChatModel``); the model's own chat template is applied.
- :class:`KVCachedTextLLM`: a text-completion LLM (``BaseLLM``).
- :class:`KVCachedRetriever`: wraps any retriever and records the documents it returns.
- :class:`KVCachedVectorStore`: wraps a vector store (``similarity_search`` and friends record too).
- :func:`register_documents`: record documents explicitly.

Requires ``pip install "kvrag[langchain]"``.
"""

from kvrag.integrations.langchain.chat_models import KVCachedLLM
from kvrag.integrations.langchain.llms import KVCachedTextLLM
from kvrag.integrations.langchain.retrievers import KVCachedRetriever, KVCachedVectorStore, register_documents

__all__ = ["KVCachedLLM", "KVCachedTextLLM", "KVCachedRetriever", "KVCachedVectorStore", "register_documents"]
