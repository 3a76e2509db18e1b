"""KV stores: the interface, keys and records, the tiers (memory, disk, remote), codecs, eviction
policies and prefetch."""

from kvrag.engine.store.base import DamagedEntryError, KVRecord, KVStore, StoreKey, chunk_key
from kvrag.engine.store.disk import DiskStore
from kvrag.engine.store.memory import MemoryStore
from kvrag.engine.store.policy import POLICIES, EvictionPolicy, LRUPolicy, PGDSFPolicy, check_policy, make_policy
from kvrag.engine.store.remote import RemoteStore
from kvrag.engine.store.tiered import TieredStore, build_store

__all__ = [
    "KVRecord",
    "KVStore",
    "StoreKey",
    "DamagedEntryError",
    "chunk_key",
    "MemoryStore",
    "DiskStore",
    "RemoteStore",
    "TieredStore",
    "build_store",
    "EvictionPolicy",
    "LRUPolicy",
    "PGDSFPolicy",
    "make_policy",
    "check_policy",
    "POLICIES",
]
