"""Agentic RAG: a retriever tool's documents inside tool messages, and each agent step's KV reuse.

A tiny random Qwen2-family engine whose template renders tools as Qwen2.5's does (``tests.helpers``):
what is checked is what the engine finds and reuses, not what a random model answers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402
from langchain_core.tools import create_retriever_tool  # noqa: E402

from kvrag.integrations.langchain import KVCachedLLM, KVCachedRetriever  # noqa: E402
from tests.helpers import make_tool_engine  # noqa: E402

DOCS = [
    Document(page_content="The Harbor Street Library opens at nine and closes at five on Saturdays."),
    Document(page_content="Its first librarian was Margaret Hale, who kept the catalogue by hand for thirty years."),
    Document(page_content="The lighthouse at Gull Point was built by the harbour board in 1871 from local granite."),
]


@pytest.fixture
def tool_engine(one_thread):
    engine = make_tool_engine()
    yield engine
    engine.close()


def search_tool(llm):
    """``create_retriever_tool`` over a :class:`KVCachedRetriever` (a retriever that returns ``DOCS``)."""
    retriever = KVCachedRetriever(retriever=RunnableLambda(lambda query: DOCS), llm=llm)
    return create_retriever_tool(retriever, "search", "Search the handbook.")


def agent_messages(output: str) -> list:
    call = {"name": "search", "args": {"query": "library hours"}, "id": "call_1", "type": "tool_call"}
    return [
        SystemMessage("Search before you answer."),
        HumanMessage("When does the library open on Saturdays?"),
        AIMessage("", tool_calls=[call]),
        ToolMessage(output, tool_call_id="call_1", name="search"),
    ]


def test_every_document_of_a_retriever_tools_output_is_found_inside_the_tool_message(tool_engine):
    llm = KVCachedLLM(engine=tool_engine)
    tool = search_tool(llm)
    output = tool.invoke({"query": "library hours"})
    assert output == "\n\n".join(d.page_content for d in DOCS)  # LangChain's separator
    tools = llm.bind_tools([tool]).kwargs["tools"]
    messages = [{"role": m.type, "content": m.content} for m in agent_messages(output)[:2]]
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "library hours"}}}
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": output},
    ]
    prompt = tool_engine.apply_chat_template(messages, tools=tools)
    assert "<tool_response>" in prompt
    chunks = [text for kind, text in tool_engine.split_prompt(prompt) if kind == "chunk"]
    assert chunks == [d.page_content for d in DOCS]


def test_the_step_after_a_tool_call_reuses_the_documents_and_the_previous_prompt(tool_engine):
    llm = KVCachedLLM(engine=tool_engine, max_tokens=2, temperature=0)
    tool = search_tool(llm)
    bound = llm.bind_tools([tool])
    config = {"configurable": {"thread_id": "run-1"}}
    messages = agent_messages(tool.invoke({"query": "library hours"}))
    tool_engine.warm([d.page_content for d in DOCS])  # the corpus computed ahead
    first = bound.invoke(messages[:2], config=config)
    tool_engine.flush()  # the first step's prefix is kept after its first token, in the background
    second = bound.invoke(messages, config=config)
    meta = second.response_metadata
    assert meta["chunk_hits"] == len(DOCS) and meta["chunk_misses"] == 0
    # the first step's prompt (system, tools, question: the exact prefix cache), then the documents' KV
    block = tool_engine.config.prefix_block_tokens  # a last partial block is kept at segment boundaries only
    assert first.usage_metadata["input_tokens"] - block < meta["exact_tokens"] <= first.usage_metadata["input_tokens"]
    assert second.usage_metadata["input_token_details"]["cache_read"] > meta["exact_tokens"]
    full = KVCachedLLM(engine=tool_engine, max_tokens=2, mode="full").bind_tools([tool]).invoke(messages)
    assert full.usage_metadata["input_token_details"]["cache_read"] == 0
    assert full.usage_metadata["input_tokens"] == second.usage_metadata["input_tokens"]  # the same prompt
