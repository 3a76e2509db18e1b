"""The KV store interface, its keys and its record.

Keys are discovered by hash and verified by tokens: a key is SHA-256 over (namespace, model
fingerprint, kind, context, token ids); a hit is only used if the record's token ids equal the
request's.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvrag.errors import KvragError

__all__ = ["StoreKey", "KVRecord", "KVStore", "DamagedEntryError", "chunk_key", "token_bytes"]


class DamagedEntryError(KvragError):
    """A stored entry failed verification while it was read (checksum, size, format).

    Stores turn damage found at lookup into a miss; this is raised only when damage shows up
    later, while a record streams in layer by layer. The engine then plans the request again
    (the damaged entry is gone by then), so callers of the engine never see it.
    """


@dataclass(frozen=True, slots=True)
class StoreKey:
    """Address of a record: a namespace (tenant) and a hex SHA-256 digest."""

    namespace: str
    digest: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.digest[:16]}"


def token_bytes(token_ids) -> bytes:
    """Canonical bytes of a token id sequence (little-endian int32)."""
    t = torch.as_tensor(token_ids, dtype=torch.int32).contiguous()
    return t.numpy().astype("<i4", copy=False).tobytes()


def chunk_key(namespace: str, fingerprint: str, token_ids, *, kind: str = "chunk", context: str = "sink") -> StoreKey:
    """Key of a chunk's KV computed behind ``context`` (a variant label; ``sink`` by default)."""
    h = hashlib.sha256()
    for part in (namespace, fingerprint, kind, context):
        h.update(part.encode())
        h.update(b"\0")
    h.update(token_bytes(token_ids))
    return StoreKey(namespace, h.hexdigest())


@dataclass(slots=True)
class KVRecord:
    """KV of a token sequence, as stored.

    Attributes:
        token_ids: [T] int64 token ids the KV belongs to (verified on every hit).
        k: [L, Hkv, T, D] keys *without* RoPE (position-free: placed anywhere by rotation).
        v: [L, Hkv, T, D] values.
        kind: ``chunk`` (a document chunk) or ``prefix`` (an exact prompt-prefix block).
        context: what the KV was computed behind: ``sink`` (alone behind the attention-sink
            token) or a label/digest of another prefix (room for Cache-Craft variants).
        meta: small JSON-able facts (e.g. the parent digest of a prefix block).
        stats: named per-layer tensors (e.g. Cache-Craft's inter/intra attention statistics).
        tier: where this copy was read from (``memory`` or ``disk``); not stored.
    """

    token_ids: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kind: str = "chunk"
    context: str = "sink"
    meta: dict = field(default_factory=dict)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    tier: str = "memory"

    def __post_init__(self) -> None:
        self.token_ids = torch.as_tensor(self.token_ids, dtype=torch.long)
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(
                f"k and v must both be [L, Hkv, T, D]; got {tuple(self.k.shape)} and {tuple(self.v.shape)}"
            )
        if self.k.shape[2] != self.token_ids.shape[0]:
            raise ValueError(f"KV covers {self.k.shape[2]} tokens but token_ids has {self.token_ids.shape[0]}")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim): what a model must have to use this KV."""
        return int(self.k.shape[0]), int(self.k.shape[1]), int(self.k.shape[3])

    @property
    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
        n += self.token_ids.numel() * 8
        return n + sum(t.numel() * t.element_size() for t in self.stats.values())

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [Hkv, T, D] of one layer (a streamed record waits for that layer only)."""
        return self.k[layer], self.v[layer]

    def clone(self) -> KVRecord:
        """A copy with tensors and meta of its own, in the same form (another store may keep it)."""
        return KVRecord(
            self.token_ids.clone(),
            self.k.clone(),
            self.v.clone(),
            kind=self.kind,
            context=self.context,
            meta=dict(self.meta),
            stats={n: t.clone() for n, t in self.stats.items()},
            tier=self.tier,
        )

    def matches(self, token_ids) -> bool:
        """True if this record holds exactly these tokens."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        return ids.shape == self.token_ids.shape and bool(torch.equal(ids, self.token_ids))


class KVStore(ABC):
    """A KV store tier (or an ordered stack of tiers). Thread-safe.

    ``get`` returns ``None`` on a miss, on a record whose tokens differ from ``token_ids``, and on
    any damaged entry: a store never raises for what it read.
    """

    @abstractmethod
    def contains(self, key: StoreKey) -> bool: ...

    @abstractmethod
    def get(self, key: StoreKey, token_ids=None) -> KVRecord | None: ...

    @abstractmethod
    def put(self, key: StoreKey, record: KVRecord, *, speculative: bool = False) -> bool:
        """Store a record; False if it was not kept (too big for the budget, write failed).

        ``speculative``: the record is kept ahead of any request for it (a refreshed variant); a tier
        with an eviction order ranks it last until it is used, and memory never evicts for it an
        entry a request kept (:class:`~kvrag.engine.store.memory.MemoryStore`).
        """

    @abstractmethod
    def remove(self, key: StoreKey) -> bool: ...

    def peek(self, key: StoreKey, token_ids=None) -> KVRecord | None:
        """The record under ``key``, read as a look, not a use: for background work that reads KV no
        request asked for (the knowledge tree's refresh). Tiers that can count no hit, leave ranks
        (and a speculative entry's "not used yet") alone and promote nothing; by default a ``get``."""
        return self.get(key, token_ids)

    def meta(self, key: StoreKey) -> dict | None:
        """The ``meta`` of the record under ``key`` (what its header carries), or ``None``: a look,
        not a use (tiers that can read a header alone count no hit and promote nothing)."""
        rec = self.get(key)
        return None if rec is None else dict(rec.meta)

    def stats(self) -> dict:
        return {}

    @contextmanager
    def pinned(self, keys):
        """Keep ``keys`` resident while the block runs, where the tier can (a no-op by default)."""
        yield

    def record_cost(self, keys, seconds_per_token: float) -> None:
        """Report what computing these missed entries cost per non-cached token (PGDSF's cost)."""

    def record_reuse(self, key: StoreKey, cfo: float) -> None:
        """Report a reuse with cache fix overhead ``cfo`` (Cache-Craft's frequency-reuse: it counts 1/CFO)."""

    def clear(self) -> None:
        """Drop every entry."""

    def close(self) -> None:
        """Release resources; the store is unusable afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
