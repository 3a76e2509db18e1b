"""The LlamaIndex drop-in on the real models: bundled MiniLM embeddings and SmolLM2 (slower)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.schema import TextNode

from kvrag.integrations.llama_index import KVCachedLLM, minilm_embedding, record_stats
from tests.integrations.llama_index_helpers import no_default_models  # noqa: F401 (autouse fixture)

HANDBOOK = Path(__file__).resolve().parents[2] / "examples" / "data" / "handbook.json"
Q1 = "Who built the lighthouse at Gull Point?"
Q2 = "When does the ferry leave Port Alder on Sundays?"

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def handbook_index():
    docs = json.loads(HANDBOOK.read_text())
    nodes = [TextNode(text=f"{d['title']}\n{d['text']}", id_=d["title"]) for d in docs]
    return VectorStoreIndex(nodes, embed_model=minilm_embedding())


def test_minilm_embedding_offline(handbook_index):
    embed = handbook_index._embed_model
    assert len(embed.get_query_embedding("lighthouse")) == 384
    top = handbook_index.as_retriever(similarity_top_k=1).retrieve(Q1)
    assert top[0].node.node_id == "Port Alder Lighthouse"


def test_query_engine_reuses_nodes(smol_engine, handbook_index):
    def query(question, **llm_kwargs):
        llm = KVCachedLLM(engine=smol_engine, max_new_tokens=12, **llm_kwargs)
        qe = handbook_index.as_query_engine(llm=llm, similarity_top_k=6, node_postprocessors=[llm.node_postprocessor()])
        with record_stats() as calls:
            response = qe.query(question)
        return response, calls[-1]

    r1, _ = query(Q1)
    smol_engine.flush()
    r2, s2 = query(Q2)
    order1 = [n.node.node_id for n in r1.source_nodes]
    order2 = [n.node.node_id for n in r2.source_nodes]
    assert sorted(order1) == sorted(order2) and order1 != order2  # same six documents, another order
    assert s2["chunk_hits"] == 6 and s2["chunk_misses"] == 0
    assert s2["recomputed_tokens"] > 0 and s2["cache_read"] > s2["prompt_tokens"] // 2
    assert str(r2).strip()
