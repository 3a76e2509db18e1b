"""LlamaIndex's ``KVCachedLLM(base_url=...)``: answers and figures through ``kvrag serve`` equal the embedded LLM's.

Each test runs the same calls on a server's engine and on ``tiny_engine`` (the same tiny model and
settings, the same request order): texts and figures must agree.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_index.core")

from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402

from kvrag.errors import InvalidRequestError  # noqa: E402
from kvrag.integrations._shared import METADATA_KEYS  # noqa: E402
from kvrag.integrations.llama_index import KVCachedLLM, register_nodes  # noqa: E402
from tests.helpers import make_docs  # noqa: E402
from tests.integrations.llama_index_helpers import BowEmbedding, no_default_models  # noqa: E402, F401 (autouse)

# what depends on this machine's timing: the timings, and how many drafts a step checked (the engine plans
# them from the decode passes it timed: kvrag.engine.serving.drafts), so the steps they saved too
TIMINGS = {"ttft_s", "total_s", "prefill_s", "decode_s", "draft_tokens", "draft_accepted", "decode_steps"}


def untimed(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if k not in TIMINGS}


@pytest.fixture
def nodes():
    return [TextNode(text=d, metadata={"title": f"doc {i}"}, id_=f"n{i}") for i, d in enumerate(make_docs(6))]


def calls(llm, engine, nodes):
    """Every kind of call once, in one order: warm, query, complete, chat, streams, async."""
    warmed = register_nodes(llm, nodes[:2], warm=True)
    index = VectorStoreIndex(nodes, embed_model=BowEmbedding())
    query_engine = index.as_query_engine(llm=llm, node_postprocessors=[llm.node_postprocessor()], similarity_top_k=3)

    def settled(call):
        """A call's result once its write-back is stored: what the next call finds must not depend
        on how fast the background writer was (on a busy machine it lags either engine)."""
        out = call()
        engine.flush()
        return out

    answers = [settled(lambda: query_engine.query("where was the king born?").response) for _ in range(2)]
    context = "\n\n".join(n.get_content() for n in nodes[:3])
    messages = [ChatMessage(role="system", content=context), ChatMessage(role="user", content="who was the king?")]
    responses = [
        settled(lambda: llm.complete(f"{context}\n\nwho was the queen?", max_tokens=4)),
        settled(lambda: llm.chat(messages)),
        settled(lambda: list(llm.stream_chat(messages, mode="full"))[-1]),
        settled(lambda: list(llm.stream_complete("the king of", formatted=True))[-1]),
        settled(lambda: asyncio.run(llm.acomplete("the poet of"))),
    ]
    return warmed, answers, responses


def test_llm_through_the_server_answers_and_reports_as_the_embedded_one(serve_tiny, tiny_engine, nodes):
    engine, url = serve_tiny()
    remote = calls(KVCachedLLM(base_url=url), engine, nodes)
    local = calls(KVCachedLLM(engine=tiny_engine), tiny_engine, nodes)
    assert remote[0].computed == local[0].computed == 2
    assert remote[1] == local[1]
    for r, lo in zip(remote[2], local[2]):
        assert str(r) == str(lo)
        assert METADATA_KEYS == set(r.additional_kwargs) == set(lo.additional_kwargs)
        assert untimed(r.additional_kwargs) == untimed(lo.additional_kwargs)
        assert r.raw["usage"] == lo.raw["usage"] and untimed(r.raw["kvrag"]) == untimed(lo.raw["kvrag"])
    first = remote[2][0].additional_kwargs  # the recorded node texts were found in the prompt and sent with it
    assert first["chunk_hits"] + first["chunk_misses"] >= 2  # at least the two warmed nodes


def test_metadata_and_conversations_come_from_the_server(serve_tiny):
    engine, url = serve_tiny()
    llm = KVCachedLLM(base_url=url, conversation_id="c1")
    meta = llm.metadata
    assert meta.context_window == engine.context_window and meta.num_output == engine.config.sampling.max_new_tokens
    assert meta.model_name == engine.model_name
    assert KVCachedLLM(base_url=url, max_new_tokens=3).metadata.num_output == 3
    llm.chat([ChatMessage(role="user", content="where was the king born?")])
    key = ("default", "c1")
    assert key in engine.conversations and llm.end_conversation() is True and key not in engine.conversations
    with pytest.raises(InvalidRequestError, match="no engine"):
        llm.tokenize("the king")
    with pytest.raises(InvalidRequestError, match="base_url"):
        KVCachedLLM(base_url=url, engine=engine)
