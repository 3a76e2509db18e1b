"""Tiers in order: memory, then local disk, then a shared remote server. Built from the engine config.

- **Lookup**: memory first, then disk, then remote; a disk or remote hit streams in layer by layer
  (see :mod:`kvrag.engine.store.prefetch`) and is promoted to memory once every layer is in and
  verified. A chunk reports the tier it came from (``memory``, ``disk``, ``remote``).
- **Store**: KV is kept at rest in one representation in every tier (``disk_dtype``, or the 8-bit
  codec's codes: :mod:`kvrag.engine.store.codec`), converted once when a record is first stored,
  so a chunk reads back the same whichever tier serves it and a request's answer does not depend
  on where its chunks were. A record goes to memory and is written to disk and to the remote
  server once, right then (write-back already runs off the request's critical path), so what
  survives a restart or a crash is on disk already and other processes find it on the server.
  A memory eviction then just drops the copy and moves the disk copy's rank (the swap-out costs
  no copy: RAGCache's swap-out-only-once); only if the disk evicted it meanwhile is it written.
  Memory and disk evict by the configured policy (LRU or PGDSF), each with its own clock; the
  server by its own ``maxmemory-policy``.
- **Damage and faults**: a damaged, truncated, refused or vanished entry is a miss; it is dropped,
  counted and warned about once. A full disk skips the write and keeps serving from memory; an
  unreachable or slow server is skipped until it is back (:mod:`kvrag.engine.store.remote`).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from pathlib import Path

from kvrag.engine.model.dtypes import dtype_name, torch_dtype
from kvrag.engine.store.base import KVRecord, KVStore, StoreKey
from kvrag.engine.store.budget import memory_budget
from kvrag.engine.store.codec import AtRest
from kvrag.engine.store.disk import DiskStore
from kvrag.engine.store.memory import MemoryStore
from kvrag.engine.store.policy import check_policy
from kvrag.engine.store.prefetch import Prefetcher, StreamedRecord, ThroughputMeter
from kvrag.errors import StoreError

log = logging.getLogger(__name__)

__all__ = ["TieredStore", "build_store"]


class TieredStore(KVStore):
    """Memory over disk over remote.

    Args:
        memory: the memory tier (its policy decides memory evictions).
        disk: the disk tier, or ``None``.
        dtype: dtype of plain K and V at rest in every tier (``float16``, ``bfloat16``, ``float32``).
        prefetch: stream disk and remote hits layer by layer in the background; ``False`` reads a
            hit whole, synchronously, at lookup.
        remote: the remote tier (:class:`~kvrag.engine.store.remote.RemoteStore`), or ``None``.
        codec: ``plain`` or ``int8``: how chunk KV is held at rest in every tier, memory included.
    """

    def __init__(
        self,
        memory: MemoryStore,
        disk: DiskStore | None,
        dtype: str = "float16",
        prefetch: bool = True,
        *,
        remote=None,
        codec: str = "plain",
    ):
        self.memory = memory
        self.disk = disk
        self.remote = remote
        self.dtype = torch_dtype(dtype)
        self.at_rest = AtRest(codec, dtype)
        self.prefetch = prefetch
        self.meter = ThroughputMeter()  # disk reads (the loading controller's default)
        self.remote_meter = ThroughputMeter()  # remote reads: their own bandwidth
        self._lower = [t for t in (disk, remote) if t is not None]
        self._prefetcher = Prefetcher()
        self._inflight: dict[StoreKey, StreamedRecord] = {}
        self._lock = threading.Lock()
        self._stats = {
            "hits": 0,
            "misses": 0,
            "promotions": 0,
            "disk_writes_skipped": 0,
            "remote_writes_skipped": 0,
            "swap_outs": 0,
        }

    @property
    def policy(self):
        return self.memory.policy

    def pinned(self, keys):
        return self.memory.pinned(keys)

    def _meter(self, tier) -> ThroughputMeter:
        return self.remote_meter if tier is self.remote else self.meter

    # -- lookups ------------------------------------------------------------------------------------

    def contains(self, key: StoreKey) -> bool:
        return self.memory.contains(key) or any(t.contains(key) for t in self._lower)

    def get(self, key: StoreKey, token_ids=None):
        """A record (memory hit, or a whole lower-tier read) or a :class:`StreamedRecord`, or ``None``."""
        rec = self._first(key, token_ids, self.memory.get, lambda tier: self._from_tier(tier, key, token_ids))
        with self._lock:
            self._stats["hits" if rec is not None else "misses"] += 1
        return rec

    def peek(self, key: StoreKey, token_ids=None):
        """A record from the first tier holding it, as a look: no hit counted, no rank touched,
        nothing promoted (a lower tier's record is read whole)."""
        return self._first(key, token_ids, self.memory.peek, lambda tier: tier.peek(key, token_ids))

    def _first(self, key: StoreKey, token_ids, from_memory, from_tier):
        """The record from memory, a read in flight, or the first lower tier that has it."""
        rec = from_memory(key, token_ids)
        if rec is None:
            rec = self._inflight_record(key, token_ids)
        for tier in self._lower:
            if rec is not None:
                break
            rec = from_tier(tier)
        return rec

    def meta(self, key: StoreKey) -> dict | None:
        """The record's ``meta`` from the first tier holding it, by its header alone: no hit
        counted, nothing promoted."""
        found = self.memory.meta(key)
        if found is None:
            inflight = self._inflight_record(key, None)
            found = None if inflight is None else dict(inflight.meta)
        for tier in self._lower:
            if found is not None:
                break
            found = tier.meta(key)
        return found

    def _inflight_record(self, key: StoreKey, token_ids):
        with self._lock:
            inflight = self._inflight.get(key)
        if inflight is not None and inflight.failure is None and (token_ids is None or inflight.matches(token_ids)):
            return inflight
        return None

    def _from_tier(self, tier, key: StoreKey, token_ids):
        entry = tier.open(key, token_ids)
        if entry is None:
            return None
        meter = self._meter(tier)
        if not self.prefetch:
            t0 = time.perf_counter()
            try:
                rec = entry.read_record()
                meter.add(entry.header.kv_nbytes, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - damage or I/O: a miss
                tier.discard(key, e)
                return None
            finally:
                entry.close()
            promoted = copy.copy(rec)
            promoted.tier = "memory"  # later hits are memory hits
            self._promote(key, promoted)
            return rec
        try:
            rec = StreamedRecord(entry, meter, lambda r, ok: self._done(tier, key, r, ok))
        except Exception as e:  # noqa: BLE001
            entry.close()
            tier.discard(key, e)
            return None
        with self._lock:
            self._inflight[key] = rec
            meter.records += 1
        self._prefetcher.submit(rec)
        return rec

    def _done(self, tier, key: StoreKey, rec: StreamedRecord, ok: bool) -> None:
        with self._lock:
            if self._inflight.get(key) is rec:
                del self._inflight[key]
        if ok:
            self._promote(key, rec.to_record())
        else:
            tier.discard(key, rec.failure)

    def _promote(self, key: StoreKey, rec: KVRecord) -> None:
        if self._to_memory(key, rec):
            with self._lock:
                self._stats["promotions"] += 1

    def _to_memory(self, key: StoreKey, rec: KVRecord, speculative: bool = False) -> bool:
        evicted = self.memory.put_evicting(key, rec, speculative=speculative)
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

    def put(self, key: StoreKey, record: KVRecord, *, speculative: bool = False) -> bool:
        """Keep a record in memory and write it to disk and remote once (skipped where it is already).

        ``speculative`` (kept ahead of need): memory takes it only into room it has or holds for other
        such entries; a PGDSF disk ranks it last until it is used (frequency 0).
        """
        rec = self.at_rest(record.to_record() if isinstance(record, StreamedRecord) else record)
        kept = self._to_memory(key, rec, speculative)
        for tier, skipped in ((self.disk, "disk_writes_skipped"), (self.remote, "remote_writes_skipped")):
            if tier is None:
                continue
            if tier.contains(key):
                with self._lock:
                    self._stats[skipped] += 1
                kept = True
                continue
            frequency, cost = self.memory.value_of(key)
            kept = tier.put(key, rec, frequency=frequency, cost=cost, speculative=speculative) or kept
        return kept

    def remove(self, key: StoreKey) -> bool:
        removed = self.memory.remove(key)
        for tier in self._lower:
            removed = tier.remove(key) or removed
        return removed

    def record_cost(self, keys, seconds_per_token: float) -> None:
        self.memory.record_cost(keys, seconds_per_token)
        if self.disk is not None:
            self.disk.record_cost(keys, seconds_per_token)

    def record_reuse(self, key: StoreKey, cfo: float) -> None:
        self.memory.record_reuse(key, cfo)

    def clear(self) -> None:
        """Drop every entry of every tier (the disk directory and the server's kvrag keys are
        emptied for every namespace)."""
        self.memory.clear()
        for tier in self._lower:
            tier.clear()

    def stats(self) -> dict:
        """Counters of the stack and of each tier.

        Top level: ``hits``/``misses``/``hit_rate`` (any tier), ``promotions`` (disk or remote hits
        copied to memory), ``swap_outs`` (memory evictions the disk had dropped, written again),
        ``disk_writes_skipped``/``remote_writes_skipped`` (already there), ``policy``, ``dtype``,
        ``codec``. ``memory``: :meth:`MemoryStore.stats` (counters, entries, bytes, tokens,
        bytes_per_token, budget_bytes, policy state). ``disk``: hits, misses, puts, evictions,
        damaged, write_errors, skipped, written_bytes, entries, bytes, budget_bytes, directory.
        ``load``: bytes and seconds read from disk, records streamed, ``throughput_bytes_per_s``.
        ``remote`` (with a remote tier): its counters (:meth:`RemoteStore.stats`) and its own ``load``.
        """
        with self._lock:
            out = dict(self._stats)
        mem = self.memory.stats()
        out.update(
            policy=mem.get("policy", {}).get("name"),
            memory=mem,
            load=self.meter.stats(),
            dtype=dtype_name(self.dtype),
            codec=self.at_rest.name,
        )
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        if self.remote is not None:
            out["remote"] = dict(self.remote.stats(), load=self.remote_meter.stats())
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else None
        return out

    def close(self) -> None:
        self._prefetcher.close()
        for tier in self._lower:
            tier.close()
        self.memory.close()


def build_store(config) -> KVStore:
    """The store an :class:`EngineConfig` asks for.

    The memory tier's budget is ``memory_budget_bytes`` (``"auto"``: a share of the machine's
    memory, :mod:`kvrag.engine.store.budget`). Without ``disk_tier`` or ``remote_url`` this is a
    :class:`MemoryStore` that keeps chunk KV as the codec says (``kv_codec``) and everything else
    as computed, in the compute dtype (exact prefix blocks stay exact). Otherwise a
    :class:`TieredStore`: memory, a disk tier over ``<cache_dir>/kv`` (the per-user cache directory
    when ``cache_dir`` is unset) if ``disk_tier``, and a
    :class:`~kvrag.engine.store.remote.RemoteStore` at ``remote_url`` if set, all holding plain KV
    in ``disk_dtype``. A disk directory that cannot be opened is skipped with a warning; a server
    that is down is kept (it is retried with backoff).

    Raises:
        InvalidRequestError: ``eviction_policy`` names no policy of :data:`~kvrag.engine.store.policy.POLICIES`.
    """
    check_policy(config.eviction_policy)
    setting = config.memory_budget_bytes
    budget = "auto" if setting == "auto" else memory_budget(setting)  # "auto": claimed by the memory tier
    codec = config.resolved_kv_codec()
    if not config.disk_tier and not config.remote_url:
        return MemoryStore(budget, config.eviction_policy, at_rest=AtRest(codec, dtype=None))
    memory = MemoryStore(budget, config.eviction_policy)
    disk = remote = None
    if config.disk_tier:
        directory = Path(config.resolved_cache_dir()) / "kv"
        try:
            disk = DiskStore(
                directory, config.disk_budget_bytes, config.disk_dtype, config.eviction_policy, codec=codec
            )
        except StoreError as e:
            log.warning("kvrag: %s; serving without the disk tier", e)
    if config.remote_url:
        from kvrag.engine.store.remote import RemoteStore  # redis is imported only when asked for

        try:
            remote = RemoteStore(
                config.remote_url,
                dtype=config.disk_dtype,
                codec=codec,
                timeout=config.remote_timeout_s,
                ttl=config.remote_ttl_s,
            )
        except StoreError as e:
            log.warning("kvrag: %s; serving without the remote tier", e)
    return TieredStore(memory, disk, config.disk_dtype, prefetch=config.prefetch, remote=remote, codec=codec)
