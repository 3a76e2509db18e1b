"""In-memory KV tier: tensors in a dict, bounded by a byte budget, LRU eviction."""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvrag.engine.store.base import KVRecord, KVStore, StoreKey

__all__ = ["MemoryStore"]


class MemoryStore(KVStore):
    """Records kept as tensors; least recently used records go first when over budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self._items: OrderedDict[StoreKey, KVRecord] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = {"hits": 0, "misses": 0, "puts": 0, "evictions": 0, "rejected": 0}

    def contains(self, key: StoreKey) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: StoreKey, token_ids=None) -> KVRecord | None:
        with self._lock:
            rec = self._items.get(key)
            if rec is None or (token_ids is not None and not rec.matches(token_ids)):
                self._stats["misses"] += 1
                return None
            self._items.move_to_end(key)
            self._stats["hits"] += 1
            return rec

    def put(self, key: StoreKey, record: KVRecord) -> bool:
        size = record.nbytes
        with self._lock:
            if size > self.budget_bytes:
                self._stats["rejected"] += 1
                return False
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._items and self._bytes + size > self.budget_bytes:
                _, victim = self._items.popitem(last=False)
                self._bytes -= victim.nbytes
                self._stats["evictions"] += 1
            self._items[key] = record
            self._bytes += size
            self._stats["puts"] += 1
            return True

    def remove(self, key: StoreKey) -> bool:
        with self._lock:
            rec = self._items.pop(key, None)
            if rec is not None:
                self._bytes -= rec.nbytes
            return rec is not None

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats, entries=len(self._items), bytes=self._bytes, budget_bytes=self.budget_bytes)

    def __len__(self) -> int:
        return len(self._items)
