"""In-memory KV tier: tensors in a dict, bounded by a byte budget, a pluggable eviction policy.

**Tenants.** The budget is shared by the namespaces (tenants) of the keys, fairly: a put that needs
room evicts from the tenant holding the most bytes, the putting tenant counted with its new entry
and winning ties (:func:`~kvrag.engine.store.tenants.fair_victim`), and inside that tenant by the
policy (each tenant has its own: :class:`~kvrag.engine.store.policy.TenantPolicies`). So a tenant
filling the budget evicts only its own KV once it holds the most, never the KV of a tenant holding
less than it; with ``N`` tenants holding KV, one holding at most ``(budget - size) / N`` bytes never
loses KV to another's put of ``size`` bytes. One tenant alone may fill the whole budget.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager

from kvrag.engine.store.base import KVRecord, KVStore, StoreKey
from kvrag.engine.store.budget import claim_auto, release_auto
from kvrag.engine.store.policy import EvictionPolicy, LRUPolicy, TenantPolicies, make_policy
from kvrag.engine.store.tenants import fair_victim

__all__ = ["MemoryStore"]


class MemoryStore(KVStore):
    """Records kept as tensors; the policy (LRU by default) names who goes when over budget.

    Args:
        budget_bytes: the most bytes of records kept (a record larger than this is refused).
        policy: an :class:`EvictionPolicy` or its name (``lru``, ``pgdsf``): each tenant's order
            (the first tenant's the one given, the others' a new one of its class).
        at_rest: what a put keeps of a record (:class:`~kvrag.engine.store.codec.AtRest`: chunk KV
            as 8-bit codes, say); ``None``: the record as given. A tier stack converts records
            itself, once for every tier, and leaves this ``None``.

    A ``speculative`` put (an entry kept ahead of need, :meth:`put`) takes only free room or the room
    of its tenant's other speculative entries not used yet (oldest first), never an entry a request
    kept: it is refused otherwise (counted ``speculative_refused``). Until a lookup hits it, its
    tenant's policy ranks it last, so that tenant's ordinary puts evict it first.

    Tenants share the budget by the fair rule of the module's docstring.
    """

    def __init__(self, budget_bytes: int | str, policy: EvictionPolicy | str | None = None, *, at_rest=None) -> None:
        # "auto": this process's share of the machine's memory, less what its other live stores claimed
        self.budget_bytes = claim_auto(self) if budget_bytes == "auto" else int(budget_bytes)
        policy = make_policy(policy) if isinstance(policy, str) else (policy or LRUPolicy())
        self.policy = TenantPolicies(policy)
        self.at_rest = at_rest
        self._items: dict[StoreKey, KVRecord] = {}
        self._sizes: dict[StoreKey, int] = {}
        self._bytes = 0
        self._held: Counter = Counter()  # namespace -> bytes of its resident records
        self._tokens = 0  # tokens of the resident records: bytes per token is what the at-rest form costs
        self._lock = threading.Lock()
        self._stats = {
            "hits": 0,
            "misses": 0,
            "puts": 0,
            "evictions": 0,
            "speculative_evictions": 0,
            "rejected": 0,
            "speculative_refused": 0,
        }
        self._pins: Counter = Counter()
        self._speculative: dict[StoreKey, None] = {}  # resident, put speculative, not hit since (oldest first)

    @contextmanager
    def pinned(self, keys):
        """Keep ``keys`` out of eviction while the block runs (unless only pinned entries are left).

        ``warm(chunks)`` pins its batch, so a policy that favours old frequent entries (PGDSF) cannot
        evict one freshly warmed chunk to make room for the next.
        """
        keys = list(keys)
        with self._lock:
            self._pins.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._pins.subtract(keys)
                self._pins += Counter()  # drop zero counts

    def contains(self, key: StoreKey) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: StoreKey, token_ids=None) -> KVRecord | None:
        with self._lock:
            rec = self._items.get(key)
            hit = rec is not None and (token_ids is None or rec.matches(token_ids))
            self.policy.access(key, hit)
            if not hit:
                self.policy.forget_idle(self._held.__contains__)
            if hit:
                self._speculative.pop(key, None)
            self._stats["hits" if hit else "misses"] += 1
            return rec if hit else None

    def peek(self, key: StoreKey, token_ids=None) -> KVRecord | None:
        """A resident record, as a look (no hit counted, the policy untouched, a speculative entry
        still not used)."""
        with self._lock:
            rec = self._items.get(key)
            return rec if rec is not None and (token_ids is None or rec.matches(token_ids)) else None

    def meta(self, key: StoreKey) -> dict | None:
        """A resident record's ``meta`` (a look: no hit counted, the policy untouched)."""
        with self._lock:
            rec = self._items.get(key)
            return None if rec is None else dict(rec.meta)

    def put(self, key: StoreKey, record: KVRecord, *, speculative: bool = False) -> bool:
        """Keep a record, evicting by the policy; ``speculative``: only in free room or in place of
        other speculative entries (see the class)."""
        return self.put_evicting(key, record, speculative=speculative) is not None

    def put_evicting(
        self, key: StoreKey, record: KVRecord, *, speculative: bool = False
    ) -> list[tuple[StoreKey, KVRecord]] | None:
        """Like :meth:`put`; returns the evicted entries (``None`` if the record was refused)."""
        if self.at_rest is not None:
            record = self.at_rest(record)  # outside the lock: encoding is the costly part
        size = record.nbytes
        evicted: list[tuple[StoreKey, KVRecord]] = []
        with self._lock:
            if size > self.budget_bytes:
                self._stats["rejected"] += 1
                return None
            tenant = key.namespace
            if speculative:
                spare = [k for k in self._speculative if k != key and k.namespace == tenant and not self._pins[k]]
                room = self.budget_bytes - self._bytes + self._sizes.get(key, 0)
                if room + sum(self._sizes[k] for k in spare) < size:
                    self._stats["speculative_refused"] += 1
                    return None
            self._drop(key)
            while self._items and self._bytes + size > self.budget_bytes:
                victim = spare.pop(0) if speculative else self._victim(fair_victim(self._held, tenant, size))
                evicted.append((victim, self._items[victim]))
                self._stats["speculative_evictions"] += victim in self._speculative
                self.policy.evicted(victim)  # before _drop: PGDSF raises its clock to the victim's priority
                self._drop(victim)
                self._stats["evictions"] += 1
            self._items[key] = record
            self._sizes[key] = size
            self._bytes += size
            self._held[tenant] += size
            self._tokens += record.num_tokens
            self.policy.insert(key, size, speculative)
            if speculative:
                self._speculative[key] = None
            self._stats["puts"] += 1
        return evicted

    def _victim(self, tenant: str) -> StoreKey:
        """The tenant's policy's next victim, not a pinned entry unless only pinned ones are left."""
        policy = self.policy
        victim = policy.victim_of(tenant, self._pins.keys()) if self._pins else policy.victim_of(tenant)
        if victim is None:  # only pinned entries left: one goes after all (the policy's pick)
            victim = policy.victim_of(tenant)
        if victim is None or victim not in self._items:  # policy out of step: fall back to the tenant's first
            victim = next((k for k in self._items if k.namespace == tenant), None) or next(iter(self._items))
        return victim

    def _drop(self, key: StoreKey) -> bool:
        rec = self._items.pop(key, None)
        if rec is None:
            return False
        self._speculative.pop(key, None)
        size = self._sizes.pop(key)
        self._bytes -= size
        self._held[key.namespace] -= size
        if self._held[key.namespace] <= 0:
            del self._held[key.namespace]
        self._tokens -= rec.num_tokens
        self.policy.remove(key)
        return True

    def remove(self, key: StoreKey) -> bool:
        with self._lock:
            return self._drop(key)

    def record_cost(self, keys, seconds_per_token: float) -> None:
        with self._lock:
            for key in keys:
                self.policy.record_cost(key, seconds_per_token)

    def value_of(self, key: StoreKey) -> tuple[int, float | None]:
        """(frequency, cost per token) the policy knows for ``key``."""
        with self._lock:
            return self.policy.value_of(key)

    def record_reuse(self, key: StoreKey, cfo: float) -> None:
        with self._lock:
            self.policy.record_reuse(key, cfo)

    def close(self) -> None:
        """Drop every entry (their memory is freed now, not when the store is collected: a closed
        engine may stay referenced) and return an ``"auto"`` budget to the process's share."""
        self.clear()
        release_auto(self)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._items):
                self._drop(key)

    def stats(self) -> dict:
        """Counters (hits, misses, puts, evictions, rejected, speculative_refused;
        ``speculative_evictions``: those of ``evictions`` that dropped a speculative entry no lookup
        had used) and what is held:
        ``entries``, ``bytes``, ``tokens`` (of every entry, variants and prefix blocks included),
        ``bytes_per_token`` (``None`` when empty), ``budget_bytes``, ``codec``, ``policy``,
        ``tenants`` (namespaces holding KV now)."""
        with self._lock:
            return dict(
                self._stats,
                entries=len(self._items),
                bytes=self._bytes,
                tokens=self._tokens,
                bytes_per_token=self._bytes / self._tokens if self._tokens else None,
                budget_bytes=self.budget_bytes,
                codec=None if self.at_rest is None else self.at_rest.name,
                policy=self.policy.describe(),
                tenants=len(self._held),
            )

    def tenant_bytes(self, namespace: str) -> int:
        """Bytes of the records ``namespace`` holds now."""
        with self._lock:
            return self._held.get(namespace, 0)

    def __len__(self) -> int:
        return len(self._items)
