"""Tenants share the memory tier by the fair rule: the tenant holding the most gives way."""

from __future__ import annotations

import pytest

from kvrag.engine.store.memory import MemoryStore
from kvrag.engine.store.tenants import fair_victim
from tests.engine.store.helpers import key, record


def test_fair_victim_is_the_largest_holder_and_ties_go_to_the_inserting_tenant():
    assert fair_victim({"a": 3, "b": 5}, "a", 1) == "b"
    assert fair_victim({"a": 4, "b": 5}, "a", 1) == "a"  # a tie after the insert: its own
    assert fair_victim({"b": 5}, "a", 9) == "b"  # it holds nothing to give
    assert fair_victim({}, "a", 1) == "a"


@pytest.mark.parametrize("policy", ["lru", "pgdsf"])
def test_a_tenant_filling_the_budget_does_not_evict_a_smaller_tenants_kv(policy):
    size = record(0).nbytes
    m = MemoryStore(10 * size, policy)
    b_keys = [key(i, namespace="b") for i in range(2)]
    for i, k in enumerate(b_keys):
        assert m.put(k, record(i))
    for i in range(50):  # tenant a fills the budget many times over
        assert m.put(key(100 + i, namespace="a"), record(100 + i))
    assert all(m.contains(k) for k in b_keys)  # a global LRU evicted b's two oldest entries first
    assert m.tenant_bytes("b") == 2 * size and m.tenant_bytes("a") == 8 * size
    assert m.stats()["bytes"] <= m.budget_bytes and m.stats()["tenants"] == 2


def test_a_newcomer_takes_room_from_the_largest_tenant_down_to_its_own_share():
    size = record(0).nbytes
    m = MemoryStore(8 * size, "lru")
    for i in range(8):
        m.put(key(i, namespace="a"), record(i))
    for i in range(8):
        m.put(key(100 + i, namespace="b"), record(100 + i))
    # b took room from a only while a held more than b will: they end at half each
    assert m.tenant_bytes("a") == m.tenant_bytes("b") == 4 * size
    # three tenants: one holding at most (budget - size) / N never loses an entry to another
    for i in range(2):
        m.put(key(200 + i, namespace="c"), record(200 + i))
    held = {ns: m.tenant_bytes(ns) // size for ns in "abc"}
    assert held == {"a": 3, "b": 3, "c": 2}


def test_a_speculative_put_takes_only_its_own_tenants_unused_entries():
    size = record(0).nbytes
    m = MemoryStore(2 * size, "lru")
    assert m.put(key(0, namespace="b"), record(0), speculative=True)
    assert m.put(key(1, namespace="a"), record(1))
    assert not m.put(key(2, namespace="a"), record(2), speculative=True)  # b's entry is not a's to take
    assert m.contains(key(0, namespace="b"))
