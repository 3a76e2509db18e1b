"""KV stores: the interface, keys and records, and the tiers."""

from kvrag.engine.store.base import KVRecord, KVStore, StoreKey, chunk_key
from kvrag.engine.store.memory import MemoryStore

__all__ = ["KVRecord", "KVStore", "StoreKey", "chunk_key", "MemoryStore"]
