"""Eviction policies of a byte-bounded tier: which resident entry goes first.

A policy sees every access (hit or miss), insertion, removal and eviction of a tier and names the
next victim. It keeps no tensors, so it is cheap to test on its own.

- :class:`LRUPolicy`: least recently used first.
- :class:`PGDSFPolicy`: RAGCache's prefix-aware Greedy-Dual-Size-Frequency (§5.1).
  ``priority = clock + frequency x cost/size``, where cost/size is the average, over the requests
  that needed the entry and did not have it, of the prefill time per non-cached token
  (``T(alpha, beta) / beta`` from the engine's own profile). The clock rises to the priority of
  each victim, so entries not used for a while age out. Frequencies count accesses in a window
  (the last ``window`` distinct keys, resident or not), so a popular chunk that was evicted comes
  back with its history.
  The frequency is Cache-Craft's frequency-reuse (§3.3): a reuse reported with its cache fix
  overhead (:meth:`KVStore.record_reuse`, the planner does for every chunk variant it uses) counts
  ``1 / CFO`` accesses, so variants that fit their prompts well outlive those that need fixing.

An entry inserted ``speculative`` (kept ahead of any request for it: the knowledge tree's refreshed
variants) ranks below every other resident entry until a lookup hits it: LRU puts it at the cold
end, PGDSF gives it the current clock (no frequency credit). So under pressure such entries go
first, and what requests themselves keep is evicted exactly as if they were not there.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass

from kvrag.errors import InvalidRequestError

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "PGDSFPolicy",
    "TenantPolicies",
    "make_policy",
    "check_policy",
    "POLICIES",
    "CFO_FLOOR",
    "MAX_IDLE_TENANTS",
]

#: A reuse with cache fix overhead ``cfo`` counts ``1 / max(cfo, CFO_FLOOR)`` accesses (an exact
#: reuse 10, a chunk reused in another context ~2): Cache-Craft's frequency-reuse.
CFO_FLOOR = 0.1

#: Tenants holding nothing whose policy (its history: PGDSF's frequencies) a tier keeps at most;
#: past that they are forgotten (:meth:`TenantPolicies.forget_idle`).
MAX_IDLE_TENANTS = 64


class EvictionPolicy(ABC):
    """Bookkeeping of one tier's entries for eviction. Not thread-safe: the tier holds its lock."""

    name = "policy"

    @abstractmethod
    def insert(self, key, size: int, speculative: bool = False) -> None:
        """A new (or replaced) resident entry; ``speculative``: ranked last until a lookup hits it."""

    @abstractmethod
    def access(self, key, hit: bool) -> None:
        """A lookup of ``key``; ``hit`` if it was resident."""

    @abstractmethod
    def remove(self, key) -> None:
        """A resident entry left for another reason than eviction (removed, damaged)."""

    @abstractmethod
    def victim(self, skip=frozenset()):
        """The resident key to evict next, not one in ``skip`` (``None`` if there is none).

        Does not remove it.
        """

    def evicted(self, key) -> None:
        """``key`` (the last victim) was evicted."""
        self.remove(key)

    def record_cost(self, key, seconds_per_token: float) -> None:
        """Computing ``key`` in a request cost this much per non-cached token."""

    def record_reuse(self, key, cfo: float) -> None:
        """``key`` was reused with Cache-Craft fix budget ``cfo``."""

    def value_of(self, key) -> tuple[int, float | None]:
        """(frequency, cost per token or ``None``) of a key, for the tier below."""
        return 1, None

    def describe(self) -> dict:
        return {"name": self.name}


class LRUPolicy(EvictionPolicy):
    """Least recently used first (speculative entries not used yet before all others, oldest first)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict = OrderedDict()
        self._unused: OrderedDict = OrderedDict()  # speculative entries not hit since their insertion

    def insert(self, key, size: int, speculative: bool = False) -> None:
        self.remove(key)
        (self._unused if speculative else self._order)[key] = size

    def access(self, key, hit: bool) -> None:
        if hit and key in self._unused:
            self._order[key] = self._unused.pop(key)
        elif hit and key in self._order:
            self._order.move_to_end(key)

    def remove(self, key) -> None:
        self._order.pop(key, None)
        self._unused.pop(key, None)

    def victim(self, skip=frozenset()):
        return next((k for k in itertools.chain(self._unused, self._order) if k not in skip), None)


@dataclass(slots=True)
class _Meta:
    frequency: float = 0.0  # accesses, reuses weighted by 1/CFO
    speculative: bool = False  # inserted ahead of need and not hit since: ranked at the clock
    total_cost: float = 0.0
    costed: int = 0  # requests that computed the entry (m in RAGCache's formula 3)

    def avg_cost(self, default: float) -> float:
        return self.total_cost / self.costed if self.costed else default


class PGDSFPolicy(EvictionPolicy):
    """RAGCache's PGDSF: ``priority = clock + frequency x avg(cost_i / newsize_i)``; lowest goes first.

    Args:
        window: distinct keys whose frequency and cost are remembered (resident or not).
    """

    name = "pgdsf"

    def __init__(self, window: int = 65536) -> None:
        self.clock = 0.0
        self.window = window
        self._meta: OrderedDict = OrderedDict()  # key -> _Meta, most recently touched last
        self._prio: dict = {}  # resident key -> current priority
        self._heap: list = []  # (priority, seq, key); stale items skipped lazily
        self._seq = itertools.count()
        self._cost_sum = 0.0
        self._cost_n = 0

    def _touch(self, key) -> _Meta:
        meta = self._meta.get(key)
        if meta is None:
            meta = self._meta[key] = _Meta()
            while len(self._meta) > self.window:  # forget the oldest non-resident history
                old = next((k for k in self._meta if k not in self._prio), None)
                if old is None:
                    break
                del self._meta[old]
        else:
            self._meta.move_to_end(key)
        return meta

    def _default_cost(self) -> float:
        """Cost of an entry never seen computed: the mean of what was seen (1.0 before any)."""
        return self._cost_sum / self._cost_n if self._cost_n else 1.0

    def priority(self, key) -> float:
        meta = self._meta.get(key) or _Meta()
        if meta.speculative:
            return self.clock
        return self.clock + max(1, meta.frequency) * meta.avg_cost(self._default_cost())

    def _reprioritise(self, key) -> None:
        p = self.priority(key)
        self._prio[key] = p
        heapq.heappush(self._heap, (p, next(self._seq), key))
        if len(self._heap) > 4 * len(self._prio) + 64:  # drop stale items now and then
            self._heap = [(p, s, k) for p, s, k in self._heap if self._prio.get(k) == p]
            heapq.heapify(self._heap)

    def insert(self, key, size: int, speculative: bool = False) -> None:
        self._touch(key).speculative = speculative
        self._reprioritise(key)

    def access(self, key, hit: bool) -> None:
        meta = self._touch(key)
        meta.frequency += 1
        if hit and key in self._prio:
            meta.speculative = False
            self._reprioritise(key)

    def record_reuse(self, key, cfo: float) -> None:
        # the access itself counted 1 already; a reuse that needed little fixing counts more
        extra = 1.0 / max(float(cfo), CFO_FLOOR) - 1.0
        if extra > 0 and key in self._prio:
            self._touch(key).frequency += extra
            self._reprioritise(key)

    def record_cost(self, key, seconds_per_token: float) -> None:
        if not seconds_per_token > 0:
            return
        meta = self._touch(key)
        meta.total_cost += seconds_per_token
        meta.costed += 1
        self._cost_sum += seconds_per_token
        self._cost_n += 1
        if key in self._prio:
            self._reprioritise(key)

    def remove(self, key) -> None:
        self._prio.pop(key, None)

    def victim(self, skip=frozenset()):
        held = []  # live items of skipped keys, pushed back afterwards
        found = None
        while self._heap:
            p, _, key = self._heap[0]
            if self._prio.get(key) != p:
                heapq.heappop(self._heap)  # stale
            elif key in skip:
                held.append(heapq.heappop(self._heap))
            else:
                found = key
                break
        for item in held:
            heapq.heappush(self._heap, item)
        return found

    def evicted(self, key) -> None:
        p = self._prio.pop(key, None)
        if p is not None:
            self.clock = max(self.clock, p)  # RAGCache formula 2

    def value_of(self, key) -> tuple[int, float | None]:
        meta = self._meta.get(key)
        if meta is None:
            return 1, None
        cost = meta.total_cost / meta.costed if meta.costed else None
        if meta.speculative:  # never used (resident or just evicted): the tier below ranks it last too
            return 0, cost
        return max(1, round(meta.frequency)), cost

    def describe(self) -> dict:
        return {
            "name": self.name,
            "clock": self.clock,
            "tracked": len(self._meta),
            "default_cost": self._default_cost(),
        }


class TenantPolicies(EvictionPolicy):
    """One policy per tenant: a key's ``namespace`` names whose policy sees it (a tier's shape).

    A tenant's entries are ranked against each other only (PGDSF: each tenant has its own clock);
    which tenant gives way is the tier's choice (:func:`~kvrag.engine.store.tenants.fair_victim`),
    then :meth:`victim_of` names the entry. With one tenant this is its policy, unchanged.

    Args:
        policy: the policy of the first tenant seen; every other tenant gets a new one of its class.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.name = policy.name
        self._first: EvictionPolicy | None = policy
        self._cls = type(policy)
        self._of: dict[str, EvictionPolicy] = {}

    def of(self, namespace: str) -> EvictionPolicy:
        """The tenant's policy (made on first use)."""
        policy = self._of.get(namespace)
        if policy is None:
            policy, self._first = self._first or self._cls(), None
            self._of[namespace] = policy
        return policy

    def tenants(self) -> list[str]:
        return list(self._of)

    def forget_idle(self, holding) -> None:
        """Forget the policies of tenants that hold nothing (``holding(namespace)`` false), beyond
        :data:`MAX_IDLE_TENANTS` of them (the oldest first)."""
        idle = [ns for ns in self._of if not holding(ns)]
        for ns in idle[: max(0, len(idle) - MAX_IDLE_TENANTS)]:
            del self._of[ns]

    def insert(self, key, size: int, speculative: bool = False) -> None:
        self.of(key.namespace).insert(key, size, speculative)

    def access(self, key, hit: bool) -> None:
        self.of(key.namespace).access(key, hit)

    def remove(self, key) -> None:
        policy = self._of.get(key.namespace)
        if policy is not None:
            policy.remove(key)

    def evicted(self, key) -> None:
        self.of(key.namespace).evicted(key)

    def victim(self, skip=frozenset()):
        """The first tenant's victim (a tier picks the tenant itself: :meth:`victim_of`)."""
        return next((v for p in self._of.values() if (v := p.victim(skip)) is not None), None)

    def victim_of(self, namespace: str, skip=frozenset()):
        """The tenant's next victim, not one in ``skip`` (``None`` if it has none)."""
        policy = self._of.get(namespace)
        return None if policy is None else policy.victim(skip)

    def record_cost(self, key, seconds_per_token: float) -> None:
        self.of(key.namespace).record_cost(key, seconds_per_token)

    def record_reuse(self, key, cfo: float) -> None:
        self.of(key.namespace).record_reuse(key, cfo)

    def value_of(self, key) -> tuple[int, float | None]:
        policy = self._of.get(key.namespace)
        return (1, None) if policy is None else policy.value_of(key)

    def describe(self) -> dict:
        first = next(iter(self._of.values()), None) or self._first
        return dict(first.describe() if first is not None else {"name": self.name}, tenants=len(self._of))


#: The eviction policies by name: the one list (``EngineConfig.eviction_policy`` is checked against it
#: when the store is built). A new policy is a class above and its entry here.
POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "pgdsf": PGDSFPolicy}


def check_policy(name) -> str:
    """``name`` if it names an eviction policy.

    Raises:
        InvalidRequestError: it does not; the message lists :data:`POLICIES`.
    """
    if not isinstance(name, str) or name not in POLICIES:
        raise InvalidRequestError(f"unknown eviction_policy {name!r}; use one of {', '.join(POLICIES)}")
    return name


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by name (one of :data:`POLICIES`; :class:`~kvrag.errors.InvalidRequestError` otherwise)."""
    return POLICIES[check_policy(name)]()
