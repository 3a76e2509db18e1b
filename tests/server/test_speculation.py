"""``kvrag serve``'s speculation fields: a request prefilled ahead and adopted by its identical later request."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402

from tests.helpers import make_docs  # noqa: E402


def rag_messages(docs, question="where was the king born?"):
    return [
        {"role": "system", "content": "Answer from the documents.\n\n" + "\n".join(docs)},
        {"role": "user", "content": question},
    ]


def wait_settled(engine):
    assert engine._worker.wait_idle(30)


def test_a_speculated_request_is_adopted_by_the_identical_request(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(3, seed=91)
    body = {"messages": rag_messages(docs), "max_tokens": 5, "documents": docs, "temperature": 0}
    spec = httpx.post(f"{url}/v1/chat/completions", json={**body, "speculate": "q1"}, timeout=60)
    assert spec.status_code == 202, spec.text
    assert spec.json()["object"] == "speculation" and spec.json()["kind"] == "prompt"
    wait_settled(engine)
    assert engine.store.stats()["puts"] == 0  # held, nothing kept before its adoption
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert engine.speculations.counts["adopted"] == 1
    engine.flush()
    engine.store.clear()
    engine.variants.index.clear()
    afresh = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()  # nothing to adopt now
    assert answer["choices"][0]["message"] == afresh["choices"][0]["message"]
    assert engine.speculations.counts["adopted"] == 1


def test_a_changed_list_or_a_delete_cancels_and_the_answer_is_computed_afresh(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(4, seed=92)
    first = {"messages": rag_messages(docs[:2]), "max_tokens": 4, "documents": docs[:2], "mode": "full"}
    second = {"messages": rag_messages(docs[1:3]), "max_tokens": 4, "documents": docs[1:3], "mode": "full"}
    httpx.post(f"{url}/v1/chat/completions", json={**first, "speculate": "q"}, timeout=60)
    wait_settled(engine)
    httpx.post(f"{url}/v1/chat/completions", json={**second, "speculate": "q"}, timeout=60)  # replaces it
    wait_settled(engine)
    other_tenant_free = httpx.delete(f"{url}/v1/speculations/unknown", timeout=60).json()
    assert other_tenant_free["deleted"] is False
    deleted = httpx.delete(f"{url}/v1/speculations/q", timeout=60).json()
    assert deleted == {"id": "q", "object": "speculation.deleted", "deleted": True}
    assert not engine.speculations.live()
    final = httpx.post(f"{url}/v1/chat/completions", json=second, timeout=60).json()
    expected = engine.generate(
        prompt=engine.apply_chat_template(rag_messages(docs[1:3])), max_new_tokens=4, mode="full"
    )
    assert final["choices"][0]["message"]["content"] == expected.text
    assert engine.speculations.counts["adopted"] == 0 and engine.speculations.counts["wasted_tokens"] > 0


def test_documents_speculation_computes_missing_chunks(serve_tiny):
    engine, url = serve_tiny()
    docs = make_docs(3, seed=93)
    answer = httpx.post(f"{url}/v1/documents", json={"documents": docs, "speculate": "q"}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["speculation"]["kind"] == "chunks"
    wait_settled(engine)
    keys = [engine.planner.chunk_key(engine.prompt_tokenizer.tokenize(d), "default") for d in docs]
    assert all(engine.store.contains(k) for k in keys) and not engine.store.stats()["hits"]
    both = httpx.post(f"{url}/v1/documents", json={"documents": docs, "speculate": "q", "warm": True}, timeout=60)
    assert both.status_code == 400


def test_conversations_are_not_speculated(serve_tiny):
    _, url = serve_tiny()
    docs = make_docs(2, seed=94)
    body = {"messages": rag_messages(docs), "documents": docs, "conversation_id": "c1", "speculate": "q"}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400 and "conversation" in answer.text
