"""Tiers in order: memory, then disk (then, later, a shared tier). Built from the engine config.

- **Lookup**: memory first; a disk hit streams in layer by layer (see
  :mod:`kvrag.engine.store.prefetch`) and is promoted to memory once every layer is in and verified.
- **Store**: KV is kept at rest in one dtype (``disk_dtype``) in every tier, so a chunk reads back
  the same whichever tier serves it, and a request's answer does not depend on where its chunks
  were. A record goes to memory and is written to disk once, right then (write-back already runs
  off the request's critical path), so what survives a restart or a crash is on disk already.
  A memory eviction then just drops the copy and moves the disk copy's rank (the swap-out costs
  no copy: RAGCache's swap-out-only-once); only if the disk evicted it meanwhile is it written.
  Both tiers evict by the configured policy (LRU or PGDSF), each with its own clock.
- **Damage**: a damaged, truncated, refused or vanished disk entry is a miss; it is dropped, counted
  and warned about once. A full disk skips the write and keeps serving from memory.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

from kvrag.engine.dtypes import dtype_name, torch_dtype
from kvrag.engine.store.base import KVRecord, KVStore, StoreKey
from kvrag.engine.store.disk import DiskStore
from kvrag.engine.store.memory import MemoryStore
from kvrag.engine.store.prefetch import Prefetcher, StreamedRecord, ThroughputMeter
from kvrag.errors import StoreError

log = logging.getLogger(__name__)

__all__ = ["TieredStore", "build_store"]


class TieredStore(KVStore):
    """Memory over disk.

    Args:
        memory: the memory tier (its policy decides memory evictions).
        disk: the disk tier, or ``None`` for memory only (KV still kept in ``dtype``).
        dtype: dtype of K and V at rest in every tier (``float16``, ``bfloat16``, ``float32``).
        prefetch: stream disk hits layer by layer in the background; ``False`` reads a disk hit
            whole, synchronously, at lookup.
    """

    def __init__(self, memory: MemoryStore, disk: DiskStore | None, dtype: str = "float16", prefetch: bool = True):
        self.memory = memory
        self.disk = disk
        self.dtype = torch_dtype(dtype)
        self.prefetch = prefetch
        self.meter = ThroughputMeter()
        self._prefetcher = Prefetcher()
        self._inflight: dict[StoreKey, StreamedRecord] = {}
        self._lock = threading.Lock()
        self._stats = {"hits": 0, "misses": 0, "promotions": 0, "disk_writes_skipped": 0, "swap_outs": 0}

    @property
    def policy(self):
        return self.memory.policy

    def pinned(self, keys):
        return self.memory.pinned(keys)

    # -- lookups ------------------------------------------------------------------------------------

    def contains(self, key: StoreKey) -> bool:
        return self.memory.contains(key) or (self.disk is not None and self.disk.contains(key))

    def get(self, key: StoreKey, token_ids=None):
        """A :class:`KVRecord` (memory hit or whole disk read) or a :class:`StreamedRecord`, or ``None``."""
        rec = self.memory.get(key, token_ids)
        if rec is None and self.disk is not None:
            rec = self._from_disk(key, token_ids)
        with self._lock:
            self._stats["hits" if rec is not None else "misses"] += 1
        return rec

    def _from_disk(self, key: StoreKey, token_ids):
        with self._lock:
            inflight = self._inflight.get(key)
        if inflight is not None and inflight.failure is None and (token_ids is None or inflight.matches(token_ids)):
            return inflight
        entry = self.disk.open(key, token_ids)
        if entry is None:
            return None
        if not self.prefetch:
            t0 = time.perf_counter()
            try:
                rec = entry.read_record()
                self.meter.add(entry.header.kv_nbytes, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - damage or I/O: a miss
                self.disk.discard(key, str(e))
                return None
            finally:
                entry.close()
            self._promote(key, dataclasses.replace(rec, tier="memory"))  # later hits are memory hits
            return rec
        try:
            rec = StreamedRecord(entry, self.meter, lambda r, ok: self._done(key, r, ok))
        except Exception as e:  # noqa: BLE001
            entry.close()
            self.disk.discard(key, str(e))
            return None
        with self._lock:
            self._inflight[key] = rec
            self.meter.records += 1
        self._prefetcher.submit(rec)
        return rec

    def _done(self, key: StoreKey, rec: StreamedRecord, ok: bool) -> None:
        with self._lock:
            if self._inflight.get(key) is rec:
                del self._inflight[key]
        if ok:
            self._promote(key, rec.to_record())
        else:
            self.disk.discard(key, str(rec.failure))

    def _promote(self, key: StoreKey, rec: KVRecord) -> None:
        if self._to_memory(key, rec):
            with self._lock:
                self._stats["promotions"] += 1

    def _to_memory(self, key: StoreKey, rec: KVRecord) -> bool:
        evicted = self.memory.put_evicting(key, rec)
        if self.disk is not None:
            for old, old_rec in evicted or ():
                frequency, cost = self.memory.value_of(old)
                # on disk already: dropped without a copy, its disk rank moves up to now; else the
                # disk evicted it meanwhile (or a write failed): swap it out now, once
                if not self.disk.touch(old, frequency, cost):
                    with self._lock:
                        self._stats["swap_outs"] += 1
                    self.disk.put(old, old_rec, frequency=frequency, cost=cost)
        return evicted is not None

    # -- writes -------------------------------------------------------------------------------------

    def _at_rest(self, record) -> KVRecord:
        if isinstance(record, StreamedRecord):
            return record.to_record()
        if record.k.dtype == self.dtype and record.v.dtype == self.dtype and record.tier == "memory":
            return record
        return KVRecord(
            record.token_ids,
            record.k.to(self.dtype),
            record.v.to(self.dtype),
            kind=record.kind,
            context=record.context,
            meta=record.meta,
            stats=record.stats,
        )

    def put(self, key: StoreKey, record: KVRecord) -> bool:
        """Keep a record in memory and write it to disk once (skipped if the disk has it already)."""
        rec = self._at_rest(record)
        kept = self._to_memory(key, rec)
        if self.disk is not None:
            if self.disk.contains(key):
                with self._lock:
                    self._stats["disk_writes_skipped"] += 1
                return True
            frequency, cost = self.memory.value_of(key)
            kept = self.disk.put(key, rec, frequency=frequency, cost=cost) or kept
        return kept

    def remove(self, key: StoreKey) -> bool:
        removed = self.memory.remove(key)
        if self.disk is not None:
            removed = self.disk.remove(key) or removed
        return removed

    def record_cost(self, keys, seconds_per_token: float) -> None:
        self.memory.record_cost(keys, seconds_per_token)
        if self.disk is not None:
            self.disk.record_cost(keys, seconds_per_token)

    def record_reuse(self, key: StoreKey, cfo: float) -> None:
        self.memory.record_reuse(key, cfo)

    def clear(self) -> None:
        """Drop every entry of every tier (the disk directory is emptied for every namespace)."""
        self.memory.clear()
        if self.disk is not None:
            self.disk.clear()

    def stats(self) -> dict:
        """Counters of the stack and of each tier.

        Top level: ``hits``/``misses``/``hit_rate`` (any tier), ``promotions`` (disk hits copied to
        memory), ``swap_outs`` (memory evictions the disk had dropped, written again),
        ``disk_writes_skipped`` (already on disk), ``policy``, ``dtype``. ``memory``: hits, misses,
        puts, evictions, rejected, entries, bytes, budget_bytes, policy state. ``disk``: hits,
        misses, puts, evictions, damaged, write_errors, skipped, written_bytes, entries, bytes,
        budget_bytes, directory. ``load``: bytes and seconds read from disk, records streamed,
        ``throughput_bytes_per_s``.
        """
        with self._lock:
            out = dict(self._stats)
        mem = self.memory.stats()
        out.update(
            policy=mem.get("policy", {}).get("name"),
            memory=mem,
            load=self.meter.stats(),
            dtype=dtype_name(self.dtype),
        )
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else None
        return out

    def close(self) -> None:
        self._prefetcher.close()
        if self.disk is not None:
            self.disk.close()


def build_store(config) -> KVStore:
    """The store an :class:`EngineConfig` asks for.

    Without ``disk_tier`` this is a :class:`MemoryStore` that keeps KV in the compute dtype
    (exact reuse). With it, a :class:`TieredStore` over ``<cache_dir>/kv`` (the per-user cache
    directory when ``cache_dir`` is unset); if that directory cannot be opened the engine warns
    and serves from memory alone.
    """
    memory = MemoryStore(config.memory_budget_bytes, config.eviction_policy)
    if not config.disk_tier:
        return memory
    directory = Path(config.resolved_cache_dir()) / "kv"
    disk = None
    try:
        disk = DiskStore(directory, config.disk_budget_bytes, config.disk_dtype, config.eviction_policy)
    except StoreError as e:
        log.warning("kvrag: %s; serving from memory only", e)
    return TieredStore(memory, disk, config.disk_dtype, prefetch=config.prefetch)
