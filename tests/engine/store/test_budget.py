"""The memory tier's default budget and what it holds per token (no model: SmolLM2-shaped records)."""

from __future__ import annotations

import pytest
import torch

from kvrag.config import EngineConfig
from kvrag.engine.store import MemoryStore, build_store
from kvrag.engine.store import budget as budget_mod
from kvrag.engine.store.base import KVRecord
from kvrag.engine.store.budget import FALLBACK_BYTES, MachineMemory, machine_memory, memory_budget
from kvrag.engine.store.codec import CodedRecord
from kvrag.errors import InvalidRequestError
from tests.engine.store.helpers import key, record

GiB = 1024**3
SMOL = dict(layers=30, heads=3, dim=64)  # SmolLM2-135M's KV: 30 layers x 3 KV heads x 64 dims
FP32_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # K and V in float32: 46,080 bytes a token


def smol_record(i: int, tokens: int, dtype=torch.bfloat16, kind: str = "chunk") -> KVRecord:
    rec = record(i, tokens=tokens, **SMOL)
    return KVRecord(rec.token_ids, rec.k.to(dtype), rec.v.to(dtype), kind=kind)


def test_auto_is_a_quarter_of_the_machine():
    assert memory_budget("auto", MachineMemory(24 * GiB, 22 * GiB)) == 6 * GiB


def test_auto_takes_at_most_half_of_what_is_free_at_start():
    assert memory_budget("auto", MachineMemory(24 * GiB, 8 * GiB)) == 4 * GiB


def test_auto_without_a_total_or_anything_known():
    assert memory_budget("auto", MachineMemory(None, 8 * GiB)) == 2 * GiB  # a quarter of what is free
    assert memory_budget("auto", MachineMemory(16 * GiB, None)) == 4 * GiB
    assert memory_budget("auto", MachineMemory(None, None)) == FALLBACK_BYTES


def test_a_byte_count_is_kept():
    assert memory_budget(12345, MachineMemory(24 * GiB, 22 * GiB)) == 12345
    assert memory_budget(0) == 0


def test_a_container_limit_below_the_physical_memory_is_the_total(tmp_path, monkeypatch):
    limit = tmp_path / "memory.max"
    limit.write_text("1073741824\n")
    unlimited = tmp_path / "unlimited"
    unlimited.write_text("max\n")
    monkeypatch.setattr(budget_mod, "_CGROUP_LIMITS", (str(unlimited),))
    physical = machine_memory().total
    assert physical is None or physical > GiB
    monkeypatch.setattr(budget_mod, "_CGROUP_LIMITS", (str(unlimited), str(limit)))
    assert machine_memory().total == GiB


def test_build_store_sizes_the_memory_tier_from_the_machine(monkeypatch):
    import weakref

    monkeypatch.setattr(budget_mod, "machine_memory", lambda: MachineMemory(24 * GiB, 20 * GiB))
    monkeypatch.setattr(budget_mod, "_claims", weakref.WeakKeyDictionary())  # no other engine of the suite's
    assert EngineConfig().memory_budget_bytes == "auto"
    assert build_store(EngineConfig()).stats()["budget_bytes"] == 6 * GiB
    assert build_store(EngineConfig(memory_budget_bytes=1000)).stats()["budget_bytes"] == 1000


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2GiB", None])
def test_config_refuses_a_budget_that_is_no_byte_count(bad):
    with pytest.raises(InvalidRequestError, match="memory_budget_bytes"):
        EngineConfig(memory_budget_bytes=bad)


def test_stats_report_tokens_and_bytes_per_token():
    store = MemoryStore(1 << 30)
    assert store.stats()["tokens"] == 0 and store.stats()["bytes_per_token"] is None
    a, b = smol_record(1, 100), smol_record(2, 300)
    store.put(key(1), a)
    store.put(key(2), b)
    st = store.stats()
    assert st["tokens"] == 400 and st["bytes"] == a.nbytes + b.nbytes
    assert st["bytes_per_token"] == pytest.approx((a.nbytes + b.nbytes) / 400)
    store.remove(key(1))
    assert store.stats()["tokens"] == 300
    store.clear()
    assert store.stats()["tokens"] == 0


def test_memory_alone_keeps_chunks_as_codes_and_prefix_blocks_as_computed():
    store = build_store(EngineConfig(kv_codec="int8", memory_budget_bytes=1 << 30))
    chunk, prefix = smol_record(1, 256), smol_record(2, 16, kind="prefix")
    store.put(key(1, tokens=256), chunk)
    store.put(key(2, tokens=16), prefix)
    held = store.get(key(1, tokens=256))
    assert isinstance(held, CodedRecord) and store.stats()["codec"] == "int8-k64-v"
    kept = store.get(key(2, tokens=16))
    assert kept is prefix and kept.k.dtype == torch.bfloat16  # exact: the computed tensors themselves
    # about 12 KB a token: under half of float32's 46 KB (bf16 alone is 23 KB plus its token ids)
    assert held.nbytes / 256 < 0.27 * FP32_PER_TOKEN


def test_memory_alone_plain_keeps_records_as_computed():
    store = build_store(EngineConfig(kv_codec="plain", memory_budget_bytes=1 << 30))
    chunk = smol_record(1, 64)
    store.put(key(1, tokens=64), chunk)
    assert store.get(key(1, tokens=64)) is chunk and store.stats()["codec"] == "plain"


def test_auto_budgets_in_one_process_share_the_quarter():
    """Engines made in one process with "auto" split the share instead of each taking a quarter; a
    closed store gives its claim back."""
    machine = MachineMemory(24 * GiB, 22 * GiB)
    before = budget_mod.claimed_auto()
    first, second = object.__new__(MemoryStore), object.__new__(MemoryStore)
    try:
        a = budget_mod.claim_auto(first, machine)
        b = budget_mod.claim_auto(second, machine)
        assert a == memory_budget("auto", machine, claimed=before)  # 6 GiB less what live engines hold
        assert b == memory_budget("auto", machine, claimed=before + a)
        assert memory_budget("auto", machine, claimed=0) == 6 * GiB
        assert memory_budget("auto", machine, claimed=4 * GiB) == 2 * GiB
        assert memory_budget("auto", machine, claimed=6 * GiB) == budget_mod.MIN_AUTO_BYTES
        budget_mod.release_auto(first)
        assert budget_mod.claimed_auto() == before + b
    finally:
        budget_mod.release_auto(first)
        budget_mod.release_auto(second)
    assert budget_mod.claimed_auto() == before


def test_a_store_made_auto_claims_and_close_releases():
    before = budget_mod.claimed_auto()
    store = MemoryStore("auto")
    assert store.budget_bytes >= budget_mod.MIN_AUTO_BYTES
    assert budget_mod.claimed_auto() == before + store.budget_bytes
    second = MemoryStore("auto")
    assert budget_mod.claimed_auto() == before + store.budget_bytes + second.budget_bytes
    store.close()
    second.close()
    assert budget_mod.claimed_auto() == before
    assert MemoryStore(12345).budget_bytes == 12345 and budget_mod.claimed_auto() == before


def test_the_floor_of_a_shared_auto_budget_never_passes_half_the_free_memory():
    assert memory_budget("auto", MachineMemory(24 * GiB, 300 * 1024**2), claimed=6 * GiB) == 150 * 1024**2
    assert memory_budget("auto", MachineMemory(24 * GiB, 100 * 1024**2)) == 50 * 1024**2  # as before the sharing
