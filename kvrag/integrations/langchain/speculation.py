"""Prompt-level speculation for a LangChain "stuff" chain (RAGCache's speculative pipelining, §5.3).

:func:`speculative_stuff_chain` builds the chain of LangChain's RAG tutorial — retrieve ``k``
documents, join them into the prompt's ``context``, render the prompt, call the LLM — around a
``KVCachedVectorStore(..., speculative=True)``. While the store's staged FAISS search runs, after
each stage whose candidate list changed, it renders the *prompt the chain would send* with those
candidates (the same prompt template, the same ``format_docs``, the LLM's own chat template and
call settings) and has the engine prefill it in idle time (:meth:`kvrag.Engine.speculate_request`);
a newer list cancels the older speculation. When the search ends, the chain calls the LLM as
usual: if the final list is the last speculated one, the LLM's request is byte-identical to the
speculated one and adopts its prefill (its first token comes at once); otherwise the speculation
is cancelled and the call runs afresh. Either way the answer is the non-speculative chain's.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import RunnableConfig, ensure_config, patch_config, run_in_executor

from kvrag.engine import Engine
from kvrag.errors import InvalidRequestError
from kvrag.integrations._shared import Prompt, call_options, registrar_of
from kvrag.integrations.langchain._common import conversation_from_config
from kvrag.integrations.langchain.chat_models import KVCachedLLM, to_chat_messages
from kvrag.integrations.langchain.llms import KVCachedTextLLM
from kvrag.integrations.langchain.retrievers import KVCachedVectorStore

__all__ = ["speculative_stuff_chain", "SpeculativeStuffChain", "join_documents"]

log = logging.getLogger(__name__)


def join_documents(docs: Sequence[Document]) -> str:
    """The documents' texts separated by blank lines (the ``format_docs`` of LangChain's RAG tutorial)."""
    return "\n\n".join(d.page_content for d in docs)


def speculative_stuff_chain(
    store: KVCachedVectorStore,
    prompt: BasePromptTemplate,
    llm: KVCachedLLM | KVCachedTextLLM,
    *,
    k: int = 4,
    format_docs: Callable[[list[Document]], str] = join_documents,
    context_key: str = "context",
    question_key: str = "question",
) -> SpeculativeStuffChain:
    """A stuff chain (retrieve → prompt → LLM) whose LLM call adopts a prefill made during the search.

    The chain answers exactly as this one does, with the same store, prompt and LLM::

        retriever = store.as_retriever(search_kwargs={"k": k})
        chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm

    (and, for a dict input, ``RunnablePassthrough.assign(context=itemgetter("question") | retriever
    | format_docs) | prompt | llm``). With ``KVCachedVectorStore(..., speculative=True)`` and a
    local engine, each changed candidate list of the staged search is speculated as the final
    prompt (:meth:`kvrag.Engine.speculate_request`); the LLM call adopts the speculation when the
    final list equals the speculated one, and runs afresh otherwise (the speculation is cancelled).
    Where prompt-level speculation cannot apply — a store that is not speculative (no speculation),
    a call that is a conversation turn (``session_id`` / ``thread_id`` / ``conversation_id`` in
    the run config: conversations are not speculated) — the store's chunk-level speculation runs
    instead. A speculation nobody adopts (an LLM cache answered, the call failed) is cancelled
    when the call ends.

    Args:
        store: the :class:`KVCachedVectorStore` to search (a FAISS store for speculation); its
            ``llm`` must resolve to the same engine as ``llm`` (the chunks are recorded there).
        prompt: the prompt template; it takes ``context_key``, ``question_key`` and any other
            variables of a dict input.
        llm: the :class:`KVCachedLLM` (chat model) or :class:`KVCachedTextLLM` that answers, local
            (not ``base_url``). Its fields are the call's settings; per-call arguments are not taken.
        k: documents retrieved.
        format_docs: how the documents become the prompt's context (default: joined by blank lines).
        context_key, question_key: the prompt variables of the context and the question.

    Returns:
        A runnable: ``invoke``/``stream``/``ainvoke``/``astream`` (and batches) of a question string,
        or of a dict holding ``question_key`` and the prompt's other variables; its output is the
        LLM's (an ``AIMessage`` for the chat model, a string for the text LLM).
    """
    if not isinstance(store, KVCachedVectorStore):
        raise InvalidRequestError(f"store must be a KVCachedVectorStore, got {type(store).__name__}")
    if not isinstance(prompt, BasePromptTemplate):
        raise InvalidRequestError(f"prompt must be a LangChain prompt template, got {type(prompt).__name__}")
    if not isinstance(llm, KVCachedLLM | KVCachedTextLLM):
        raise InvalidRequestError(f"llm must be a kvrag KVCachedLLM or KVCachedTextLLM, got {type(llm).__name__}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InvalidRequestError(f"k must be a positive integer, got {k!r}")
    if not callable(format_docs):
        raise InvalidRequestError("format_docs must be a function of a list of documents")
    return SpeculativeStuffChain(store, prompt, llm, k, format_docs, context_key, question_key)


class SpeculativeStuffChain(Runnable[Any, Any]):
    """The runnable :func:`speculative_stuff_chain` returns (build it with that function)."""

    def __init__(
        self,
        store: KVCachedVectorStore,
        prompt: BasePromptTemplate,
        llm: KVCachedLLM | KVCachedTextLLM,
        k: int,
        format_docs: Callable[[list[Document]], str],
        context_key: str,
        question_key: str,
    ) -> None:
        self.store, self.prompt, self.llm, self.k = store, prompt, llm, k
        self.format_docs, self.context_key, self.question_key = format_docs, context_key, question_key
        self.answer = prompt | llm  # what runs once the documents are known

    # -- the runnable interface ----------------------------------------------------------------------

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._invoke, input, ensure_config(config), run_type="chain", **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._acall_with_config(self._ainvoke, input, ensure_config(config), run_type="chain", **kwargs)

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Any]:
        yield from self._transform_stream_with_config(iter([input]), self._transform, ensure_config(config), **kwargs)

    async def astream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        async def one() -> AsyncIterator[Any]:
            yield input

        async for chunk in self._atransform_stream_with_config(
            one(), self._atransform, ensure_config(config), **kwargs
        ):
            yield chunk

    def _invoke(self, input: Any, run_manager: Any, config: RunnableConfig) -> Any:
        child = patch_config(config, callbacks=run_manager.get_child())
        variables, held = self._retrieve(input, child)
        try:
            return self.answer.invoke(variables, child)
        finally:
            _release(held)

    async def _ainvoke(self, input: Any, run_manager: Any, config: RunnableConfig) -> Any:
        child = patch_config(config, callbacks=run_manager.get_child())
        variables, held = await run_in_executor(child, self._retrieve, input, child)  # the search blocks
        try:
            return await self.answer.ainvoke(variables, child)
        finally:
            _release(held)

    def _transform(self, inputs: Iterator[Any], run_manager: Any, config: RunnableConfig) -> Iterator[Any]:
        child = patch_config(config, callbacks=run_manager.get_child())
        variables, held = self._retrieve(_last(inputs), child)
        try:
            yield from self.answer.stream(variables, child)
        finally:
            _release(held)

    async def _atransform(self, inputs: AsyncIterator[Any], run_manager: Any, config: RunnableConfig):
        child = patch_config(config, callbacks=run_manager.get_child())
        value = None
        async for item in inputs:
            value = item
        variables, held = await run_in_executor(child, self._retrieve, value, child)
        try:
            async for chunk in self.answer.astream(variables, child):
                yield chunk
        finally:
            _release(held)

    # -- retrieval with speculation -----------------------------------------------------------------

    def _variables(self, input: Any) -> tuple[str, dict[str, Any]]:
        if isinstance(input, str):
            return input, {self.question_key: input}
        if isinstance(input, dict) and isinstance(input.get(self.question_key), str):
            return input[self.question_key], dict(input)
        raise InvalidRequestError(f"the chain takes a question string or a dict with a {self.question_key!r} string")

    def _retrieve(self, input: Any, config: RunnableConfig) -> tuple[dict[str, Any], list]:
        """The prompt variables (context included) and the speculations started (the last one held)."""
        question, variables = self._variables(input)
        held: list = []
        store = self.store
        pairs = None
        if store.speculative and self.llm.base_url is None and conversation_from_config(config) is None:
            engine = self.llm.get_engine()
            if registrar_of(store.llm) is not engine:
                raise InvalidRequestError(
                    "the store records its documents for another engine than the LLM's: "
                    "give KVCachedVectorStore(..., llm=) the same LLM"
                )
            speculate = self._speculator(engine, variables, held)
            pairs = store._staged(store.vectorstore._embed_query(question), self.k, {}, speculate)
        if pairs is not None:
            docs = [d for d, _ in store._record_scored(pairs)]
        else:  # not speculative, or a conversation turn: the store's own search (chunk-level where it speculates)
            docs = store.similarity_search(question, k=self.k)
        return {**variables, self.context_key: self.format_docs(docs)}, held

    def _speculator(self, engine: Engine, variables: dict[str, Any], held: list) -> Callable[[list[Document]], Any]:
        """What the staged search starts on a changed list: the prefill of the prompt it would make."""
        key = object()  # this call's own: a newer list's speculation replaces the older one
        options = call_options(self.llm.call_defaults(), {"stop": None}, owner=type(self.llm).__name__)
        options.pop("model")  # the engine is the LLM's (get_engine())

        def speculate(docs: list[Document]):
            if not all(isinstance(d, Document) for d in docs):
                return None  # a docstore gap: the final search raises, nothing to speculate
            try:
                engine.register([d.page_content for d in docs])  # as the store records the final list
                value = self.prompt.format_prompt(**{**variables, self.context_key: self.format_docs(docs)})
                if isinstance(self.llm, KVCachedLLM):
                    rendered = Prompt.chat(to_chat_messages(value.to_messages()))
                else:
                    rendered = self.llm._prompt(value.to_string())
                handle = engine.speculate_request(prompt=rendered.render(engine), key=key, **options)
            except Exception as exc:  # the final call meets the same problem and reports it
                log.debug("prompt speculation skipped: %s", exc)
                return None
            held.append(handle)
            return handle

        return speculate


def _last(values: Iterator[Any]) -> Any:
    value = None
    for item in values:
        value = item
    return value


def _release(held: list) -> None:
    """Cancel the speculations a call did not adopt (a no-op for the adopted one)."""
    for handle in held:
        handle.cancel()
