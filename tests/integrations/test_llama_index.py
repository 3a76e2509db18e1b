"""The LlamaIndex drop-in: KVCachedLLM, node registration, query and chat engines (tiny engine)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.llms import ChatMessage
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode

from kvrag import Engine
from kvrag.engine.types import GenerationStream
from kvrag.errors import ContextLengthError, InvalidRequestError
from kvrag.integrations.llama_index import (
    KVCachedLLM,
    KVCachedNodePostprocessor,
    KVCachedRetriever,
    conversation,
    node_texts,
    record_stats,
    register_nodes,
)
from tests.helpers import make_docs, stored_contexts
from tests.integrations.llama_index_helpers import BowEmbedding, no_default_models  # noqa: F401 (autouse fixture)

STAT_KEYS = {
    "ttft_s",
    "prompt_tokens",
    "completion_tokens",
    "cache_read",
    "chunk_hits",
    "chunk_misses",
    "recomputed_tokens",
    "conversation_tokens",
    "deduplicated_chunks",
}


def test_default_model_guard_is_armed():
    from llama_index.core import Settings

    with pytest.raises(AssertionError, match="default model"):
        Settings.llm  # noqa: B018
    with pytest.raises(AssertionError, match="default model"):
        Settings.embed_model  # noqa: B018


@pytest.fixture
def llm(tiny_engine):
    return KVCachedLLM(engine=tiny_engine)


@pytest.fixture
def nodes():
    return [TextNode(text=d, metadata={"title": f"doc {i}"}, id_=f"n{i}") for i, d in enumerate(make_docs(8))]


@pytest.fixture
def index(nodes):
    return VectorStoreIndex(nodes, embed_model=BowEmbedding())


def spy_calls(engine, argument: str) -> list:
    """Records one keyword argument of every ``engine.stream`` call (for this test's engine)."""
    seen: list = []
    original = engine.stream

    def stream(*args, **kwargs):
        seen.append(kwargs[argument])
        return original(*args, **kwargs)

    engine.stream = stream
    return seen


def spy_prompts(engine) -> list[str]:
    return spy_calls(engine, "prompt")


# -- the LLM -------------------------------------------------------------------------------------


def test_construction_is_cheap_and_strict(monkeypatch):
    import kvrag.engine as engine_pkg

    monkeypatch.setattr(engine_pkg, "get_engine", lambda *a, **k: pytest.fail("engine loaded at construction"))
    llm = KVCachedLLM(mode="full", max_new_tokens=5)
    llm.node_postprocessor()
    assert llm._engine is None
    with pytest.raises(ValueError, match="max_tokns"):
        KVCachedLLM(max_tokns=5)
    with pytest.raises(InvalidRequestError):
        KVCachedLLM(engine="not an engine")


def test_metadata(llm, tiny_engine):
    meta = llm.metadata
    assert meta.context_window == tiny_engine.context_window
    assert meta.num_output == tiny_engine.config.sampling.max_new_tokens
    assert meta.is_chat_model and not meta.is_function_calling_model
    assert meta.model_name == tiny_engine.model_name
    assert KVCachedLLM(engine=tiny_engine, context_window=300, max_new_tokens=4).metadata.num_output == 4


def test_complete_and_chat_use_the_chat_template(llm, tiny_engine):
    user = [{"role": "user", "content": "river castle"}]
    expected = tiny_engine.generate(prompt=tiny_engine.apply_chat_template(user))
    res = llm.complete("river castle")
    assert res.text == expected.text
    assert STAT_KEYS <= set(res.additional_kwargs)
    assert res.raw["usage"]["prompt_tokens"] == expected.stats.prompt_tokens
    assert res.raw["usage"]["completion_tokens"] == len(expected.token_ids)
    chat = llm.chat([ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="river castle")])
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "river castle"}]
    assert chat.message.content == tiny_engine.generate(prompt=tiny_engine.apply_chat_template(msgs)).text
    assert chat.additional_kwargs["prompt_tokens"] > 0
    # formatted=True sends the prompt as is; a system_prompt becomes a system message
    assert llm.complete("raw text prompt", formatted=True).text == tiny_engine.generate(prompt="raw text prompt").text
    sys_llm = KVCachedLLM(engine=tiny_engine, system_prompt="be brief")
    assert sys_llm.complete("river castle").text == chat.message.content


def test_streaming_is_cumulative_with_deltas(llm):
    full = llm.complete("king queen", max_new_tokens=6)
    parts = list(llm.stream_complete("king queen", max_new_tokens=6))
    assert "".join(p.delta for p in parts) == full.text == parts[-1].text
    text = ""
    for p in parts:
        text += p.delta
        assert p.text == text
    assert parts[-1].delta == "" and parts[-1].additional_kwargs["completion_tokens"] == 6
    chats = list(llm.stream_chat([ChatMessage(role="user", content="king queen")], max_new_tokens=6))
    assert chats[-1].message.content == full.text == "".join(c.delta for c in chats)


def test_per_call_arguments_and_errors(llm, tiny_engine):
    assert llm.complete("river", max_tokens=3).additional_kwargs["completion_tokens"] <= 3
    assert llm.complete("river", mode="full").additional_kwargs["mode"] == "full"
    with pytest.raises(InvalidRequestError, match="temprature"):
        llm.complete("river", temprature=0.5)
    with pytest.raises(InvalidRequestError, match="unknown mode"):
        llm.complete("river", mode="fast")
    with pytest.raises(InvalidRequestError, match="unknown selection"):  # handed to the engine per call
        llm.complete("river", selection="oracle")
    seen = spy_calls(tiny_engine, "selection")
    llm.complete("river", max_tokens=1, selection="recency")
    KVCachedLLM(engine=tiny_engine, selection="probe").complete("river", max_tokens=1)
    assert seen == ["recency", "probe"]
    long = " ".join(["river"] * (tiny_engine.context_window + 10))
    with pytest.raises(ContextLengthError, match=str(tiny_engine.context_window)):
        llm.complete(long)
    with pytest.raises(ContextLengthError):  # raised by the call, not at the first iteration
        llm.stream_chat([ChatMessage(role="user", content=long)])


def test_async_runs_off_the_event_loop(llm, tiny_engine):
    threads: set[int] = set()
    original = tiny_engine.stream

    def stream(*args, **kwargs):
        threads.add(threading.get_ident())
        inner = original(*args, **kwargs)

        def pieces():
            for piece in inner:
                threads.add(threading.get_ident())
                yield piece
            return inner.generation

        return GenerationStream(pieces())

    tiny_engine.stream = stream
    msgs = [ChatMessage(role="user", content="harbor museum")]

    async def main():
        loop_thread = threading.get_ident()
        done = await llm.acomplete("harbor museum")
        chat = await llm.achat(msgs)
        streamed = [r async for r in await llm.astream_complete("harbor museum")]
        chat_streamed = [r async for r in await llm.astream_chat(msgs)]
        return loop_thread, done, chat, streamed, chat_streamed

    loop_thread, done, chat, streamed, chat_streamed = asyncio.run(main())
    tiny_engine.stream = original
    assert threads and loop_thread not in threads
    assert done.text == llm.complete("harbor museum").text == streamed[-1].text
    assert "".join(r.delta for r in streamed) == done.text
    assert chat.message.content == chat_streamed[-1].message.content == llm.chat(msgs).message.content
    assert STAT_KEYS <= set(streamed[-1].additional_kwargs)


def test_async_errors_surface_at_await(llm, tiny_engine):
    long = " ".join(["river"] * (tiny_engine.context_window + 10))

    async def main():
        with pytest.raises(ContextLengthError):
            await llm.astream_complete(long)
        with pytest.raises(ContextLengthError):
            await llm.achat([ChatMessage(role="user", content=long)])

    asyncio.run(main())


# -- registration and segmentation ---------------------------------------------------------------


def test_node_texts_cover_what_llama_index_renders(nodes):
    node = TextNode(text="  " + make_docs(1)[0], metadata={"title": "T"})
    forms = node_texts(NodeWithScore(node=node, score=1.0))
    expected = {node.get_content(m) for m in (MetadataMode.LLM, MetadataMode.NONE)}
    expected |= {t.strip() for t in expected}
    assert set(forms) == expected and len(forms) == len(expected) >= 3
    with pytest.raises(InvalidRequestError):
        node_texts("not a node")


@pytest.mark.parametrize("response_mode", ["compact", "tree_summarize"])
def test_rendered_prompts_split_at_every_node(llm, tiny_engine, index, response_mode):
    prompts = spy_prompts(tiny_engine)
    qe = index.as_query_engine(
        llm=llm, similarity_top_k=4, response_mode=response_mode, node_postprocessors=[llm.node_postprocessor()]
    )
    first = qe.query("river castle king")
    kinds = tiny_engine.split_prompt(prompts[-1])
    chunks = [t for k, t in kinds if k == "chunk"]
    # compact / tree_summarize strip each node and join them with blank lines: all four found
    assert len(first.source_nodes) == 4
    assert chunks == [n.node.get_content(MetadataMode.LLM).strip() for n in first.source_nodes]
    tiny_engine.flush()
    with record_stats() as calls:
        second = qe.query("castle river king of France")
    shared = {n.node.node_id for n in first.source_nodes} & {n.node.node_id for n in second.source_nodes}
    assert len(shared) >= 2
    assert calls[-1]["chunk_hits"] >= len(shared)
    assert calls[-1]["cache_read"] > 0 and calls[-1]["recomputed_tokens"] > 0
    # recompute ratio 1.0 through the whole pipeline gives the full prefill's answer
    full = index.as_query_engine(llm=KVCachedLLM(engine=tiny_engine, mode="full"), response_mode=response_mode)
    exact = index.as_query_engine(llm=KVCachedLLM(engine=tiny_engine, recompute_ratio=1.0), response_mode=response_mode)
    assert str(exact.query("castle river king of France")) == str(full.query("castle river king of France"))


def test_unregistered_nodes_are_plain_text(llm, tiny_engine, index):
    prompts = spy_prompts(tiny_engine)
    with record_stats() as calls:
        index.as_query_engine(llm=llm, similarity_top_k=3).query("river castle")  # no postprocessor
    assert all(k == "text" for k, _ in tiny_engine.split_prompt(prompts[-1]))
    assert calls[-1]["chunk_hits"] == calls[-1]["chunk_misses"] == 0


def test_retriever_wrapper_and_register_nodes(llm, tiny_engine, index, nodes):
    retriever = KVCachedRetriever(index.as_retriever(similarity_top_k=3), llm)
    qe = RetrieverQueryEngine.from_args(retriever, llm=llm)
    prompts = spy_prompts(tiny_engine)
    qe.query("harbor museum")
    assert sum(k == "chunk" for k, _ in tiny_engine.split_prompt(prompts[-1])) == 3
    got = asyncio.run(retriever.aretrieve("harbor museum"))
    assert len(got) == 3
    texts = [node_texts(n)[0].strip() for n in nodes]  # the form the warm computes (the prompts' own)
    tiny_engine.flush()  # the queries' write-back has kept the chunks they retrieved
    before = tiny_engine.lookup(chunks=texts).chunks_stored
    warm = register_nodes(tiny_engine, nodes, warm=True)
    assert (warm.computed, warm.cached) == (len(nodes) - before, before)
    assert tiny_engine.lookup(chunks=texts).chunks_stored == len(nodes)  # the warm stored every node
    with pytest.raises(InvalidRequestError):
        KVCachedRetriever(index.as_retriever(), "llm")
    with pytest.raises(InvalidRequestError):
        KVCachedNodePostprocessor(llm=object())


def test_warmed_nodes_hit_on_the_first_query(llm, tiny_engine, index, nodes):
    register_nodes(llm, nodes, warm=True)
    qe = index.as_query_engine(llm=llm, similarity_top_k=3, node_postprocessors=[llm.node_postprocessor()])
    with record_stats() as calls:
        qe.query("river castle")
    assert calls[-1]["chunk_hits"] == 3 and calls[-1]["chunk_misses"] == 0


# -- chat engine, conversations -------------------------------------------------------------------


def test_condense_plus_context_chat_engine(tiny_engine, nodes):
    # 4 nodes, top-3: any two turns share >= 2 nodes, whatever the tiny model's condensed question
    index = VectorStoreIndex(nodes[:4], embed_model=BowEmbedding())
    llm = KVCachedLLM(engine=tiny_engine, conversation_id="chat-1")
    prompts = spy_prompts(tiny_engine)
    chat = index.as_chat_engine(
        chat_mode="condense_plus_context", llm=llm, similarity_top_k=3, node_postprocessors=[llm.node_postprocessor()]
    )
    with record_stats() as calls:
        r1 = chat.chat("river castle king")
        tiny_engine.flush()
        r2 = chat.chat("and the castle?")  # a condense call, then the answer
        tiny_engine.flush()
        streamed = "".join(chat.stream_chat("river castle king of France").response_gen)
    assert len(calls) == 5 and streamed
    turn1, condense, turn2, _, turn3 = calls
    answer_prompts = [prompts[0], prompts[2], prompts[4]]
    assert all(sum(k == "chunk" for k, _ in tiny_engine.split_prompt(p)) == 3 for p in answer_prompts)
    shared = {n.node.node_id for n in r1.source_nodes} & {n.node.node_id for n in r2.source_nodes}
    assert turn1["chunk_hits"] == 0 and len(shared) >= 2
    # shared nodes hit the chunk store; at most the first one may lose its hit to the
    # conversation's exact prefix when that prefix runs a few tokens into it ("title: doc ")
    assert turn2["chunk_hits"] >= len(shared) - 1 >= 1 and turn3["chunk_hits"] >= 1
    assert turn2["cache_read"] > turn2["prefix_tokens"]
    # the conversation's kept turn is the previous answer call, not the condense call
    assert turn2["conversation_tokens"] > 0 and turn3["conversation_tokens"] > 0
    assert condense["conversation_tokens"] == 0
    # documents sit in the system message, before the history: an earlier turn's copy is no longer
    # in the prompt, so nothing may be dropped
    assert turn2["deduplicated_chunks"] == turn3["deduplicated_chunks"] == 0
    assert llm.end_conversation() is True and llm.end_conversation() is False


def test_conversation_context_applies_to_chat_calls_only(llm, tiny_engine):
    msgs = [ChatMessage(role="user", content="river castle king of France and Spain")]
    with conversation("ctx-1"):
        llm.chat(msgs)
        llm.complete("a side call, not a turn")
        follow_up = [ChatMessage(role="assistant", content="ok"), ChatMessage(role="user", content="and?")]
        second = llm.chat(msgs + follow_up)
    assert second.additional_kwargs["conversation_tokens"] > 0
    assert tiny_engine.end_conversation("ctx-1")
    explicit = llm.complete("river castle", conversation_id="c-2")
    assert explicit.additional_kwargs["prompt_tokens"] > 0 and tiny_engine.end_conversation("c-2")
    with pytest.raises(InvalidRequestError):
        with conversation(""):
            pass


def test_async_chat_engine_keeps_the_conversation(tiny_engine, nodes):
    index = VectorStoreIndex(nodes[:4], embed_model=BowEmbedding())
    llm = KVCachedLLM(engine=tiny_engine)
    chat = index.as_chat_engine(
        chat_mode="condense_plus_context", llm=llm, similarity_top_k=2, node_postprocessors=[llm.node_postprocessor()]
    )

    async def main():
        with conversation("async-1"):  # a context variable: follows the worker threads
            await chat.achat("river castle king")
            stream = await chat.astream_chat("and the harbor?")
            return "".join([t async for t in stream.async_response_gen()])

    with record_stats() as calls:
        text = asyncio.run(main())
    assert text and len(calls) == 3
    assert calls[0]["chunk_misses"] == 2 and calls[2]["conversation_tokens"] > 0
    assert tiny_engine.end_conversation("async-1")


def test_register_nodes_warm_orders_by_the_nodes_own_embeddings(tiny_engine, tiny_model, tiny_tokenizer, nodes):
    from kvrag.integrations.llama_index.nodes import node_texts

    nodes = nodes[:4]
    vectors = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.1, 1.0]]  # 0 with 2, 1 with 3
    for node, vec in zip(nodes, vectors):
        node.embedding = vec
    register_nodes(tiny_engine, nodes, warm=True)
    forms = [node_texts(n)[0].strip() for n in nodes]
    with Engine.from_model(tiny_model, tiny_tokenizer) as ref:
        ref.warm(forms, order="similar", embeddings=vectors)
        assert stored_contexts(tiny_engine, forms) == stored_contexts(ref, forms)


def test_frequency_order_is_opt_in_and_keeps_rank_score_and_prompt_text(llm, tiny_engine, nodes):
    """Default: the nodes themselves, as they come, counted once per pass (under every form).
    ``order="frequency"``: copies, most retrieved lately first, scores kept, rank in metadata that
    the LLM's text does not show."""
    scored = [NodeWithScore(node=n, score=1.0 - i / 10) for i, n in enumerate(nodes[:3])]
    plain = KVCachedNodePostprocessor(llm=llm)
    assert plain.postprocess_nodes(scored[2:]) == scored[2:]
    assert plain.postprocess_nodes(scored[1:])[0] is scored[1]
    ordered = KVCachedNodePostprocessor(llm=llm, order="frequency")
    got = ordered.postprocess_nodes(scored)
    assert [n.node.node_id for n in got] == ["n2", "n1", "n0"]
    assert [n.score for n in got] == [scored[2].score, scored[1].score, scored[0].score]
    assert [n.node.metadata["kvrag_rank"] for n in got] == [2, 1, 0]
    assert node_texts(got[0]) == node_texts(scored[2])  # the rank is not in the text the LLM reads
    assert "kvrag_rank" not in nodes[2].metadata
    form = node_texts(nodes[2])[0].strip()  # the form compact/refine put in prompts
    assert tiny_engine.access.counts("default", [form, nodes[2].get_content()]) == [3, 3]
    assert tiny_engine.chunk_access().retrievals == 3
    with pytest.raises(ValueError, match="unknown chunk order 'hot'; use one of 'retrieval', 'frequency'"):
        KVCachedNodePostprocessor(llm=llm, order="hot")


def test_retriever_wrapper_orders_by_frequency(llm, tiny_engine, index, nodes):
    retriever = KVCachedRetriever(index.as_retriever(similarity_top_k=3), llm, order="frequency")
    first = retriever.retrieve("harbor museum")
    assert [n.node.metadata["kvrag_rank"] for n in first] == [0, 1, 2]  # nothing counted: retrieval order
    for _ in range(2):
        tiny_engine.record_retrieval([node_texts(first[2])])
    again = asyncio.run(retriever.aretrieve("harbor museum"))
    assert [n.node.node_id for n in again][0] == first[2].node.node_id
    with pytest.raises(InvalidRequestError, match="unknown chunk order"):
        KVCachedRetriever(index.as_retriever(), llm, order="x")
