"""``base_url=``: the LangChain and LlamaIndex LLMs through ``kvrag serve`` answer and report as the embedded ones;
LangChain's ``ChatOpenAI`` gets chunk reuse from the server too.

Each test runs the same calls on a server's engine and on ``tiny_engine`` (the same tiny model and
settings; same request order, so the same cache state): texts and figures must agree.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("langchain_core")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402

from kvrag import InvalidRequestError  # noqa: E402
from kvrag.integrations._shared import METADATA_KEYS  # noqa: E402
from kvrag.integrations.langchain import KVCachedLLM, KVCachedRetriever, KVCachedTextLLM  # noqa: E402
from tests.helpers import make_docs  # noqa: E402

# what depends on this machine's timing (drafts are planned from timed decode passes)
TIMINGS = {"ttft_s", "total_s", "draft_tokens", "draft_accepted", "decode_steps"}
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the documents.\n\n{context}"), ("human", "{question}")]
)


class ListRetriever(BaseRetriever):
    """Returns the documents whose index is in the query's ``order`` (a fake search)."""

    docs: list[Document]

    def _get_relevant_documents(self, query, *, run_manager):
        return [self.docs[int(x)] for x in query.split(":")[0].split(",")]


@pytest.fixture
def documents():
    return [Document(page_content=t.strip()) for t in make_docs(5, words=50)]


def same(remote: dict, local: dict) -> None:
    """Remote and embedded metadata: the same keys, the same values but for timings."""
    assert set(remote) == set(local) and METADATA_KEYS <= set(remote)
    assert {k: v for k, v in remote.items() if k not in TIMINGS} == {k: v for k, v in local.items() if k not in TIMINGS}


def run_chain(llm, engine, documents):
    retriever = KVCachedRetriever(retriever=ListRetriever(docs=documents), llm=llm)
    context = retriever | (lambda ds: "\n\n".join(d.page_content for d in ds))
    chain = {"context": context, "question": RunnablePassthrough()} | PROMPT | llm
    first = chain.invoke("0,1,2,3: where was the king born?")
    engine.flush()
    second = chain.invoke("3,1,0,4: and the queen?")
    engine.flush()  # chunk 4's write-back lands before the next call on either engine (no race)
    last = None
    for last in chain.stream("4,2: and the poet?"):  # noqa: B007 - the last chunk carries the figures
        pass
    return first, second, last


def test_langchain_chat_model_through_the_server(serve_tiny, tiny_engine, documents):
    engine, url = serve_tiny()
    remote = run_chain(KVCachedLLM(base_url=url, max_tokens=6), engine, documents)
    local = run_chain(KVCachedLLM(engine=tiny_engine, max_tokens=6), tiny_engine, documents)
    for r, lo in zip(remote, local):
        assert r.content == lo.content
        same(r.response_metadata, lo.response_metadata)
        assert r.usage_metadata == lo.usage_metadata
    assert remote[0].response_metadata["chunk_misses"] == 4 and remote[1].response_metadata["chunk_hits"] == 3


def test_langchain_text_llm_and_async_through_the_server(serve_tiny, tiny_engine):
    engine, url = serve_tiny()
    prompt = "the king of the river city was born in"
    remote_llm, local_llm = (
        KVCachedTextLLM(base_url=url, max_tokens=5),
        KVCachedTextLLM(engine=tiny_engine, max_tokens=5),
    )
    remote, local = remote_llm.generate([prompt]), local_llm.generate([prompt])
    r, lo = remote.generations[0][0], local.generations[0][0]
    assert r.text == lo.text
    assert r.generation_info.pop("usage_metadata") == lo.generation_info.pop("usage_metadata")
    same(r.generation_info, lo.generation_info)
    assert remote.llm_output == local.llm_output

    async def last_chunk(llm):
        last = None
        async for last in llm.astream([("human", "where was the queen born?")]):  # noqa: B007
            pass
        return last

    remote_chunk = asyncio.run(last_chunk(KVCachedLLM(base_url=url, max_tokens=4)))
    local_chunk = asyncio.run(last_chunk(KVCachedLLM(engine=tiny_engine, max_tokens=4)))
    same(remote_chunk.response_metadata, local_chunk.response_metadata)


def test_base_url_choices_are_checked(serve_tiny, tiny_engine):
    with pytest.raises(ValueError, match="base_url"):
        KVCachedLLM(base_url="http://127.0.0.1:1", engine=tiny_engine)
    with pytest.raises(ValueError, match="base_url"):
        KVCachedLLM(base_url="http://127.0.0.1:1", engine_config={"dtype": "bfloat16"})
    with pytest.raises(InvalidRequestError, match="no engine"):
        KVCachedLLM(base_url="http://127.0.0.1:1").get_engine()
    _, url = serve_tiny()
    with pytest.raises(InvalidRequestError, match="mode"):
        KVCachedLLM(base_url=url).invoke("hi", mode="turbo")


def test_chat_openai_gets_chunk_reuse_from_the_server(serve_tiny, tiny_engine):
    langchain_openai = pytest.importorskip("langchain_openai")
    engine, url = serve_tiny()
    docs = make_docs(3, seed=2)
    messages = [("system", "Answer from the documents.\n\n" + "\n".join(docs)), ("human", "where was the king born?")]
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{url}/v1", api_key="unused", model="default", max_tokens=6, extra_body={"documents": docs}
    )
    first = llm.invoke(messages)
    engine.flush()
    second = llm.invoke(messages)
    tiny_engine.register(docs)
    expected = KVCachedLLM(engine=tiny_engine, max_tokens=6)
    assert first.content == expected.invoke(messages).content
    tiny_engine.flush()
    assert second.content == expected.invoke(messages).content
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    assert second.usage_metadata["input_token_details"]["cache_read"] >= 3 * 40
    chunks = list(llm.stream(messages, stream_usage=True))
    assert "".join(c.content for c in chunks) == second.content
    assert (
        sum(c.usage_metadata["input_tokens"] for c in chunks if c.usage_metadata)
        == second.usage_metadata["input_tokens"]
    )
