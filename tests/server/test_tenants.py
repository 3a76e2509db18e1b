"""Tenants over HTTP (issue 59): one cannot learn, read, change, end or evict what another holds."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402

from kvrag.server import ServerSettings, TenantMap  # noqa: E402
from tests.helpers import make_docs  # noqa: E402
from tests.server.test_app import rag_messages  # noqa: E402

KEYS = ServerSettings(tenants=TenantMap(api_keys={"key-a": "tenant-a", "key-b": "tenant-b"}))
A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
SEEN = ("chunk_hits", "chunk_misses", "prompt_tokens", "cached_tokens", "computed_tokens", "path", "path_reason")


def test_b_cannot_tell_whether_a_registered_a_text(serve_tiny):
    engine, url = serve_tiny(KEYS)
    registered, unregistered = make_docs(2, seed=31)
    httpx.post(f"{url}/v1/documents", json={"documents": [registered], "warm": True}, headers=A, timeout=60)
    engine.flush()
    seen = []
    for text in (registered, unregistered):
        body = {"messages": rag_messages([text]), "max_tokens": 1, "mode": "full"}
        data = httpx.post(f"{url}/v1/chat/completions", json=body, headers=B, timeout=60).json()
        stats = data["kvrag"]["stats"]
        seen.append({k: stats[k] for k in SEEN} | {"cached": data["usage"]["prompt_tokens_details"]["cached_tokens"]})
    for figures in seen:  # the two texts have different lengths: compare what depends on registration
        figures.pop("prompt_tokens"), figures.pop("computed_tokens")
    assert seen[0] == seen[1]


def test_a_default_tenant_caller_cannot_reach_another_tenants_conversation(serve_tiny):
    engine, url = serve_tiny(ServerSettings(tenants=TenantMap(trust_header=True)))
    tenant_a = {"X-Kvrag-Tenant": "a"}
    body = {"messages": [{"role": "user", "content": "where was the king born?"}], "max_tokens": 2}
    first = httpx.post(f"{url}/v1/chat/completions", json={**body, "conversation_id": "c1"}, headers=tenant_a).json()
    answer = first["choices"][0]["message"]["content"]
    follow = [
        *body["messages"],
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and the queen?"},
    ]
    turn = {"messages": follow, "max_tokens": 2, "conversation_id": "c1"}
    for forged in ("c1", "a%00c1", "a%1Fc1"):  # the id itself, or a key spelled with a control character
        deleted = httpx.delete(f"{url}/v1/conversations/{forged}", timeout=60)
        assert deleted.status_code == 400 or deleted.json()["deleted"] is False
    forged_turn = {**body, "conversation_id": "a\u0000c1"}
    assert httpx.post(f"{url}/v1/chat/completions", json=forged_turn, timeout=60).status_code == 400
    as_default = httpx.post(f"{url}/v1/chat/completions", json=turn, timeout=60).json()
    assert as_default["kvrag"]["stats"]["conversation_tokens"] == 0  # its own conversation c1: a new one
    as_a = httpx.post(f"{url}/v1/chat/completions", json=turn, headers=tenant_a, timeout=60).json()
    assert as_a["kvrag"]["stats"]["conversation_tokens"] > 0  # a's turn was kept, untouched
    assert httpx.delete(f"{url}/v1/conversations/c1", headers=tenant_a, timeout=60).json()["deleted"] is True


def test_a_filling_the_memory_budget_does_not_evict_bs_kv(serve_tiny):
    engine, url = serve_tiny(KEYS, memory_budget_bytes=3 << 20)
    b_docs = make_docs(2, seed=32)
    httpx.post(f"{url}/v1/documents", json={"documents": b_docs, "warm": True}, headers=B, timeout=60)
    for seed in range(33, 45):  # A warms far more than the budget holds
        httpx.post(f"{url}/v1/documents", json={"documents": make_docs(4, seed=seed), "warm": True}, headers=A)
    engine.flush()
    stats = engine.store.stats()
    assert stats.get("memory", stats)["evictions"] > 0  # the budget was under pressure
    body = {"messages": rag_messages(b_docs), "max_tokens": 1, "mode": "reuse"}
    data = httpx.post(f"{url}/v1/chat/completions", json=body, headers=B, timeout=60).json()
    assert data["kvrag"]["chunk_hits"] == 2
